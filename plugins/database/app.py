"""The component's entry point for componentize-py: exports the Database plugin."""

import capstan.component

from database import DatabasePlugin

Reconciler = capstan.component.export(DatabasePlugin())
