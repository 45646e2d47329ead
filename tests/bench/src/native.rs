//! What the native Uuid controller computes: the same status Capstan writes for the Uuid
//! plugin (its fields, `observedGeneration`, the `Ready` condition), so that the two do
//! the same work per parent. `tests/equivalence.rs` holds it to Capstan's own `plan`.

use serde_json::{Map, Value, json};

/// Field manager of the native controller: one per controller, as Capstan has one per
/// plugin (`capstan/uuid`).
pub const FIELD_MANAGER: &str = "native/uuid";

/// The full status to write for a Uuid `parent` (as JSON): the UUID already in its
/// status if it is a well-formed one, else `new_uuid()`; `now` stamps a condition whose
/// status changes.
pub fn uuid_status(parent: &Value, new_uuid: impl FnOnce() -> String, now: &str) -> Value {
    let current = parent.get("status").and_then(Value::as_object);
    let uuid = current
        .and_then(|s| s.get("uuid"))
        .and_then(Value::as_str)
        .filter(|u| is_uuid(u))
        .map(String::from)
        .unwrap_or_else(new_uuid);
    let generation = parent.pointer("/metadata/generation").cloned();
    let mut status = Map::new();
    status.insert("state".into(), json!("Ok"));
    status.insert("message".into(), json!("UUID generated"));
    status.insert("uuid".into(), json!(uuid));
    if let Some(g) = &generation {
        status.insert("observedGeneration".into(), g.clone());
    }
    status.insert(
        "conditions".into(),
        Value::Array(ready_conditions(current, generation.as_ref(), now)),
    );
    Value::Object(status)
}

/// The parent's conditions with `Ready=True` (`Reconciled`) set: the others kept, the
/// transition time kept while the status does not change, sorted by type.
fn ready_conditions(
    current: Option<&Map<String, Value>>,
    generation: Option<&Value>,
    now: &str,
) -> Vec<Value> {
    let previous: Vec<Value> = current
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let is_ready = |c: &Value| c.get("type").and_then(Value::as_str) == Some("Ready");
    let since = previous
        .iter()
        .find(|c| is_ready(c))
        .filter(|c| c.get("status").and_then(Value::as_str) == Some("True"))
        .and_then(|c| c.get("lastTransitionTime").cloned())
        .unwrap_or_else(|| json!(now));
    let mut ready = json!({
        "type": "Ready",
        "status": "True",
        "reason": "Reconciled",
        "message": "0 children applied",
        "lastTransitionTime": since,
    });
    if let Some(g) = generation {
        ready["observedGeneration"] = g.clone();
    }
    let mut conditions: Vec<Value> = previous.into_iter().filter(|c| !is_ready(c)).collect();
    conditions.push(ready);
    let type_of = |c: &Value| {
        c.get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    conditions.sort_by_key(type_of);
    conditions
}

/// A random (version 4) UUID from the operating system's secure random source, as the
/// plugin takes it from the sandbox's.
pub fn uuid_v4() -> Result<String, getrandom::Error> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    ))
}

/// Whether `s` looks like a UUID (the plugin's own test).
pub fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// The current time as Kubernetes writes it (RFC 3339, seconds, UTC).
pub fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_well_formed_v4() {
        let u = uuid_v4().unwrap();
        assert!(is_uuid(&u) && &u[14..15] == "4", "{u}");
        assert_ne!(u, uuid_v4().unwrap());
    }

    #[test]
    fn an_existing_uuid_is_kept() {
        let kept = "0b3d4a39-6f64-4d2a-9f62-2b8d3c1e5a77";
        let parent = json!({"metadata": {"generation": 2}, "status": {"uuid": kept}});
        let status = uuid_status(&parent, || unreachable!("no new UUID"), "t");
        assert_eq!(status["uuid"], kept);
        assert_eq!(status["observedGeneration"], 2);
    }
}
