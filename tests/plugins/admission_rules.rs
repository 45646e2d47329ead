//! The admission rules of the test plugins `ticket` and `pass`, on a parent's spec:
//! `refuse: MESSAGE` refuses it with MESSAGE, `warn: TEXT` allows it with the warning
//! TEXT, `sleep: true` makes `validate` sleep for ever, `panic: true` makes it panic,
//! and `owner` may not change once set.

use serde_json::Value;

/// `validate` of both plugins.
pub fn validate(old: Option<&Value>, new: &Value) -> Result<Vec<String>, String> {
    let spec = &new["spec"];
    if spec["sleep"] == true {
        // Time spent outside wasm code (a WASI sleep), then inside it: the host's
        // deadline must end both.
        std::thread::sleep(std::time::Duration::from_secs(3600));
        loop {
            std::hint::black_box(0);
        }
    }
    if spec["panic"] == true {
        panic!("spec.panic is set");
    }
    if let Some(message) = spec["refuse"].as_str() {
        return Err(message.to_string());
    }
    if let Some(old) = old
        && let (Some(before), after) = (old["spec"]["owner"].as_str(), &spec["owner"])
        && after.as_str() != Some(before)
    {
        return Err(format!(
            "spec.owner cannot change once set (it was {before:?})"
        ));
    }
    Ok(spec["warn"]
        .as_str()
        .map(String::from)
        .into_iter()
        .collect())
}
