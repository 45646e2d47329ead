"""The component's entry point for componentize-py: exports the plugin."""

import capstan.component

from {{module}} import {{kind}}Plugin

Reconciler = capstan.component.export({{kind}}Plugin())
