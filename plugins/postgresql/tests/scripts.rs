//! placeholder
#[test]
fn t() {
    assert!(!capstan_plugin_postgresql::scripts::DUMP.is_empty());
}
