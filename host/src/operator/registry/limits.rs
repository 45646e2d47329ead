//! A plugin's limits file (`NAME.toml` beside `NAME.wasm`): read when its version
//! starts serving and again whenever the file is added, changed or removed; a bad file
//! leaves the limits the plugin had, and says why in `/plugins`.

use std::path::Path;
use std::time::{Instant, SystemTime};

use tracing::{error, info, warn};

use super::PluginRegistry;
use crate::grant::{Grant, Refused};
use crate::operator::metrics::PluginState;
use crate::operator::source::{FileStamp, file_stamp};
use crate::plugin::{Plugin, limits};

/// Whether the grant the limits file of `path` set on `plugin` (the defaults without one)
/// allows what `plugin` declares.
pub(super) fn granted(path: &Path, plugin: &Plugin) -> Result<(), Refused> {
    let grant = plugin.limits_file().grant.unwrap_or_default();
    grant.check(plugin.info(), &limits::file_of(path).display().to_string())
}

impl PluginRegistry {
    /// The grant of the plugin file `path`, from the `[grant]` of its limits file (the
    /// defaults without one; a bad file is reported when the limits are applied), and
    /// the limits file's stamp. Read on a blocking thread.
    pub(super) async fn grant_of(&self, path: &Path) -> (Option<FileStamp>, Grant) {
        let (wasm, config) = (path.to_path_buf(), self.sandbox.config().clone());
        tokio::task::spawn_blocking(move || {
            let stamp = file_stamp(&limits::file_of(&wasm));
            let grant = limits::read(&wasm, &config)
                .ok()
                .flatten()
                .and_then(|l| l.grant);
            (stamp, grant.unwrap_or_default())
        })
        .await
        .unwrap_or_default()
    }

    /// Hands the serving version of `path` its limits file again when that file was
    /// added, changed or removed since it was last read.
    pub(super) async fn refresh_limits(&mut self, path: &Path, stamp: Option<(u64, SystemTime)>) {
        let Some(state) = self.files.get_mut(path) else {
            return;
        };
        if state.limits_stamp == Some(stamp) {
            return;
        }
        let Some((plugin, _)) = &state.serving else {
            // A file refused (by its grant, say) is tried again when the file that holds
            // its grant changes.
            let changed = state.limits_stamp.is_some();
            state.limits_stamp = Some(stamp);
            if changed && state.error.is_some() {
                let attempts = state.retry.map_or(0, |(_, n)| n);
                state.retry = Some((Instant::now(), attempts));
            }
            return;
        };
        let plugin = plugin.clone();
        let before = plugin.limits_file();
        let error = self.apply_limits(path, &plugin, before.clone()).await;
        if let Err(refused) = granted(path, &plugin) {
            // The grant was narrowed under a serving plugin: it stops, as if refused at
            // load; its resources are left alone.
            let state = self.files.get_mut(path).expect("state exists");
            if let Some((_, controller)) = state.serving.take() {
                controller.stop().await;
            }
            self.withdraw_webhook(path).await;
            return self.failed(path, refused.to_string());
        }
        // The Secrets a grant allows are what the plugin's related watch asks the API
        // server for: new labels, new watches (the controller starts again).
        let secrets =
            |file: &limits::LimitsFile| file.grant.as_ref().and_then(|g| g.secrets.clone());
        if secrets(&before) != secrets(&plugin.limits_file()) {
            let state = self.files.get_mut(path).expect("state exists");
            if let Some((serving, controller)) = state.serving.take() {
                controller.stop().await;
                info!(file = %path.display(), "the grant's Secret labels changed: the plugin's watches start again");
                let controller = self.start_controller(path, &serving);
                let state = self.files.get_mut(path).expect("state exists");
                state.serving = Some((serving, controller));
            }
        }
        // The deadline may have changed, and the webhook's timeout with it.
        if let Some(webhooks) = &self.opts.webhooks
            && let Err(e) = webhooks.update(path, Some(&plugin)).await
        {
            warn!(file = %path.display(), "cannot tell the API server the webhook's new timeout: {e}");
        }
        let state = self.files.get_mut(path).expect("state exists");
        state.error = error.clone();
        self.metrics
            .set_plugin(PluginState::of(path, Some(&plugin), error));
    }

    /// Reads the limits file of `path` and sets it on `plugin`; a bad file is reported
    /// (the message is returned) and `plugin` gets `fallback`, the limits it had.
    pub(super) async fn apply_limits(
        &mut self,
        path: &Path,
        plugin: &Plugin,
        fallback: limits::LimitsFile,
    ) -> Option<String> {
        let file = limits::file_of(path);
        // Read on a blocking thread, like the directory: a slow volume must not hold a
        // runtime worker.
        let (wasm, config) = (path.to_path_buf(), self.sandbox.config().clone());
        let read = tokio::task::spawn_blocking(move || {
            let stamp = file_stamp(&limits::file_of(&wasm));
            (stamp, limits::read(&wasm, &config))
        })
        .await;
        let (stamp, read) = match read {
            Ok(done) => done,
            Err(e) => {
                return Some(format!(
                    "limits not changed: reading them did not complete: {e}"
                ));
            }
        };
        if let Some(state) = self.files.get_mut(path) {
            state.limits_stamp = Some(stamp);
        }
        match read {
            Ok(limits) => {
                let limits = limits.unwrap_or_default();
                if stamp.is_some() {
                    info!(file = %file.display(), plugin = %plugin.info().name, ?limits, "plugin limits set");
                }
                plugin.set_limits(limits);
                None
            }
            Err(e) => {
                let message = format!("limits not changed: {e}");
                error!(plugin = %plugin.info().name, "{message}");
                plugin.set_limits(fallback);
                Some(message)
            }
        }
    }
}
