//! Test plugin `stall`: its `describe` never returns (it sleeps, then spins), so that
//! loading it must be bounded by the call deadline like any other call.

use capstan_sdk::prelude::*;

/// The plugin.
pub struct Stall;

impl Plugin for Stall {
    fn describe() -> PluginInfo {
        // Time outside wasm code first (a WASI sleep), then inside it.
        std::thread::sleep(std::time::Duration::from_secs(3600));
        loop {
            std::hint::black_box(0);
        }
    }

    fn reconcile(_ctx: &Context) -> Result<Desired, Error> {
        Ok(Desired::new())
    }
}

capstan_sdk::export_plugin!(Stall);
