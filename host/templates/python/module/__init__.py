"""The ``{{kind}}`` plugin ({{group}}/{{version}}): each {{kind}} gets a ConfigMap holding its
``spec.message``, and reports in its status whether the ConfigMap exists yet."""

from capstan import CONFIG_MAP, Context, Desired, Invalid, KindRef, Plugin, PluginInfo

from .crd import CRD_JSON

VERSION = "0.1.0"


class {{kind}}Plugin(Plugin):
    """Reconciles ``{{kind}}`` into one ConfigMap."""

    def describe(self) -> PluginInfo:
        return PluginInfo(
            name="{{name}}",
            version=VERSION,
            parent=KindRef("{{group}}", "{{version}}", "{{kind}}", "{{plural}}"),
            children=[CONFIG_MAP],
            # Shipped in `describe`: `capstan crd` prints it and `capstan run
            # --install-crds` applies it.
            crd=CRD_JSON,
        )

    def reconcile(self, ctx: Context) -> Desired:
        message = ctx.spec.get("message")
        if not isinstance(message, str) or not message.strip():
            raise Invalid("spec.message: a non-empty string is required")
        name = f"{ctx.name}-{{singular}}"
        exists = ctx.child(CONFIG_MAP, name) is not None

        desired = Desired()
        desired.child(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": ctx.name}},
                "data": {"message": message},
            }
        )
        desired.status({"phase": "Ready" if exists else "Pending", "configMap": name})
        if exists:
            desired.condition("ConfigMapReady", True, "Observed", f"ConfigMap {name} exists")
        else:
            desired.condition("ConfigMapReady", False, "Created", f"ConfigMap {name} was asked for")
        return desired
