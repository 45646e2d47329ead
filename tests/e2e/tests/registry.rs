//! The live plugin directory's retries under `capstan run`: a file refused for a reason
//! that goes away is loaded once it does, without being touched again.

use std::time::Duration;

use capstan_e2e::objects::{create_object, uuid_kind};
use capstan_e2e::operator::{Operator, plugin};
use capstan_e2e::{TestNamespace, client, wait_for};
use kube::api::{Api, DynamicObject};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn state_of<'a>(states: &'a [Value], file: &str) -> Option<&'a Value> {
    states.iter().find(|s| {
        s["file"]
            .as_str()
            .is_some_and(|f| f.ends_with(&format!("/{file}")))
    })
}

#[tokio::test]
async fn a_file_refused_because_its_kind_was_claimed_loads_once_the_claim_goes() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "claims").await;
    let op = Operator::start(&ns.name, &[&plugin("uuid")], &[]).await;
    let dir = op.plugins.path().to_path_buf();
    // Same kind, another file: refused while uuid.wasm serves the kind.
    std::fs::copy(plugin("uuid"), dir.join("uuid2.wasm")).unwrap();
    wait_for("uuid2.wasm refused", T, || async {
        let states = op.plugin_states().await?;
        Ok(state_of(&states, "uuid2.wasm").and_then(|s| s["error"].as_str().map(String::from)))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));

    // The claim goes: the refused file is tried again (same bytes) and takes over.
    std::fs::remove_file(dir.join("uuid.wasm")).unwrap();
    wait_for("uuid2.wasm serving", T, || async {
        let states = op.plugin_states().await?;
        Ok(state_of(&states, "uuid2.wasm")
            .filter(|s| s["serving"] == true && s["error"].is_null())
            .map(|_| ()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let ar = uuid_kind();
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &ar);
    create_object(&api, &ar, "u", json!({})).await;
    wait_for("u reconciled by the plugin of uuid2.wasm", T, || async {
        Ok(api.get("u").await?.data.pointer("/status/uuid").map(|_| ()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
}
