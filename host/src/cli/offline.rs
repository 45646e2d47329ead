//! The commands that run a plugin without a cluster: `render`, `validate`, `convert`,
//! `inspect`, `crd` and `rbac`.

use std::path::Path;

use anyhow::Result;

use capstan::plugin::{Plugin, Sandbox};
use capstan::render;

/// `capstan render`: one reconcile offline, printed as YAML.
pub fn render(
    plugin: &Plugin,
    parent: &Path,
    observed: Option<&Path>,
    related: Option<&Path>,
) -> Result<()> {
    let mut observed = render::read_observed(plugin, parent, observed)?;
    let existing = match related {
        Some(path) => render::read_related(plugin.info(), path)?,
        None => Vec::new(),
    };
    render::customize(plugin, &mut observed, &existing)?;
    let rendered = render::render(plugin, &observed, &capstan::plan::now())?;
    print!("{}", serde_yaml_ng::to_string(&rendered)?);
    Ok(())
}

/// `capstan validate`: the plugin's admission verdict on a create (no `old`) or an
/// update; warnings on stderr, a refusal as the error.
pub fn validate(plugin: &Plugin, old: Option<&Path>, new: &Path) -> Result<()> {
    let old = old.map(render::read_one).transpose()?;
    let new = render::read_one(new)?;
    anyhow::ensure!(
        plugin.info().validation.is_some(),
        "plugin {} does not validate (it does not declare validation)",
        plugin.info().name
    );
    match plugin.validate_blocking(old.as_ref(), &new)? {
        Ok(warnings) => {
            for warning in warnings {
                eprintln!("warning: {}", warning.replace('\n', " "));
            }
            Ok(())
        }
        Err(refusal) => anyhow::bail!("refused: {refusal}"),
    }
}

/// `capstan convert`: an object converted to another version of the plugin's kind.
pub fn convert(plugin: &Plugin, object: &Path, to: &str) -> Result<()> {
    let converted = capstan::convert::convert(plugin, render::read_one(object)?, to)?;
    print!("{}", serde_yaml_ng::to_string(&converted)?);
    Ok(())
}

/// `capstan inspect`: what the plugin declares, with its digest.
pub fn inspect(plugin: &Plugin) -> Result<()> {
    let mut info = serde_json::to_value(plugin.info())?;
    info["sha256"] = plugin.sha256().into();
    info["crd"] = plugin.info().crd.is_some().into();
    print!("{}", serde_yaml_ng::to_string(&info)?);
    Ok(())
}

/// `capstan crd`: the CRD the plugin ships.
pub fn crd(plugin: &Plugin) -> Result<()> {
    let Some(crd) = &plugin.info().crd else {
        anyhow::bail!("plugin {} ships no CRD", plugin.info().name);
    };
    let crd: serde_json::Value = serde_json::from_str(crd)?;
    print!("{}", serde_yaml_ng::to_string(&crd)?);
    Ok(())
}

/// `capstan rbac`: the ClusterRole the plugins of a directory need.
pub fn rbac(
    sandbox: &Sandbox,
    plugins: &Path,
    name: &str,
    install_crds: bool,
    webhook_configuration: &str,
    plugin_identities: Option<&str>,
) -> Result<()> {
    let infos = super::distribute::wasm_files(plugins)?
        .iter()
        .map(|f| Ok(sandbox.load_file_blocking(f)?.info().clone()))
        .collect::<Result<Vec<_>>>()?;
    let role = capstan::rbac::cluster_role(
        name,
        &infos,
        install_crds,
        webhook_configuration,
        plugin_identities.is_some(),
    );
    print!("{}", serde_yaml_ng::to_string(&role)?);
    if let Some(namespace) = plugin_identities {
        let mut objects = capstan::rbac::impersonation(&infos, namespace, name);
        for info in &infos {
            objects.extend(capstan::rbac::plugin_identity(info, namespace, name));
        }
        for object in objects {
            print!("---\n{}", serde_yaml_ng::to_string(&object)?);
        }
    }
    Ok(())
}
