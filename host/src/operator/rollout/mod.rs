//! Rolling out a plugin's next version beside the serving one (`NAME.next.wasm`): the
//! slot it waits in ([`slot`]), shadow mode, which calls it on the serving version's
//! observed state and compares the plans ([`shadow`]), and the canary, which lets it
//! serve a growing share of the parents and rolls it back on failures ([`canary`],
//! stepped by [`driver`]). The modules import downwards only: slot and canary know
//! nothing of the controller; the metrics know nothing of them.

pub mod canary;
pub mod driver;
pub mod shadow;
pub mod slot;
pub mod staging;
