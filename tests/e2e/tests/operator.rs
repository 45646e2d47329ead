//! `capstan run` against the real local control plane: the Uuid plugin, the test plugins
//! with children and a finalizer, refused output, and the live plugin directory.

use std::time::Duration;

use capstan_e2e::operator::{Operator, plugin, test_plugin, uuid_other_build};
use capstan_e2e::{TestNamespace, client, holds_for, wait_for};
use k8s_openapi::api::core::v1::{ConfigMap, Event, Secret, Service};
use kube::Client;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn ar(group: &str, kind: &str, plural: &str, version: &str) -> ApiResource {
    ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: format!("{group}/{version}"),
        kind: kind.into(),
        plural: plural.into(),
    }
}

fn uuid_ar() -> ApiResource {
    ar("demo.operator", "Uuid", "uuid", "v1")
}

fn widget_ar() -> ApiResource {
    ar("test.capstan.dev", "Widget", "widgets", "v1")
}

fn guard_ar() -> ApiResource {
    ar("test.capstan.dev", "Guard", "guards", "v1")
}

/// Creates an object, retrying while its CRD is still being installed by the operator.
async fn create(
    client: &Client,
    ns: &str,
    ar: &ApiResource,
    name: &str,
    spec: Value,
) -> DynamicObject {
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), ns, ar);
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": ar.api_version, "kind": ar.kind,
        "metadata": {"name": name}, "spec": spec,
    }))
    .unwrap();
    wait_for(&format!("create {} {name}", ar.kind), T, || {
        let (api, obj) = (api.clone(), obj.clone());
        async move { Ok(Some(api.create(&PostParams::default(), &obj).await?)) }
    })
    .await
    .unwrap()
}

async fn get(
    client: &Client,
    ns: &str,
    ar: &ApiResource,
    name: &str,
) -> kube::Result<DynamicObject> {
    Api::<DynamicObject>::namespaced_with(client.clone(), ns, ar)
        .get(name)
        .await
}

async fn patch_spec(client: &Client, ns: &str, ar: &ApiResource, name: &str, spec: Value) {
    Api::<DynamicObject>::namespaced_with(client.clone(), ns, ar)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": spec})),
        )
        .await
        .unwrap();
}

fn ready(obj: &DynamicObject) -> Option<(String, String)> {
    let conds = obj.data.pointer("/status/conditions")?.as_array()?;
    let ready = conds.iter().find(|c| c["type"] == "Ready")?;
    Some((
        ready["status"].as_str()?.to_string(),
        ready["reason"].as_str()?.to_string(),
    ))
}

/// Waits until the object's status satisfies `check`, and returns the object.
async fn await_status(
    client: &Client,
    ns: &str,
    ar: &ApiResource,
    name: &str,
    what: &str,
    check: impl Fn(&DynamicObject) -> bool,
) -> DynamicObject {
    let check = &check;
    wait_for(what, T, || async move {
        let obj = get(client, ns, ar, name).await?;
        Ok(check(&obj).then_some(obj))
    })
    .await
    .unwrap()
}

async fn warning_events(client: &Client, ns: &str, name: &str, reason: &str) -> Vec<Event> {
    Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.involved_object.name.as_deref() == Some(name)
                && e.type_.as_deref() == Some("Warning")
                && e.reason.as_deref() == Some(reason)
        })
        .collect()
}

fn uuid_of(obj: &DynamicObject) -> String {
    obj.data
        .pointer("/status/uuid")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

#[tokio::test]
async fn uuid_gets_a_uuid_that_survives_restart_resync_and_reload() {
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "uuid").await;
    let mut op = Operator::start(&ns.name, &[&plugin("uuid")], &["--resync-seconds", "1"]).await;
    create(&client, &ns.name, &uuid_ar(), "first", json!({})).await;
    let obj = await_status(&client, &ns.name, &uuid_ar(), "first", "status.uuid", |o| {
        !uuid_of(o).is_empty()
    })
    .await;
    let uuid = uuid_of(&obj);
    assert_eq!(uuid.len(), 36, "{uuid}");
    assert_eq!(&uuid[14..15], "4", "v4 UUID: {uuid}");
    assert_eq!(obj.data["status"]["state"], "Ok");
    assert_eq!(
        obj.data["status"]["observedGeneration"],
        json!(obj.metadata.generation.unwrap())
    );
    assert_eq!(ready(&obj), Some(("True".into(), "Reconciled".into())));

    // Resync: reconciles keep coming (every second) and neither the UUID nor the status
    // changes; the status is written once, never again.
    let series = "capstan_reconciles_total{plugin=\"uuid\",result=\"ok\"}";
    let before = op.counter(series).await.unwrap();
    // The counter moves just after the write the test saw; wait for it, then require
    // that it was exactly one.
    let writes = wait_for("the status write to be counted", T, || async {
        let n = op
            .counter("capstan_status_writes_total{plugin=\"uuid\"}")
            .await?;
        Ok((n > 0).then_some(n))
    })
    .await
    .unwrap();
    assert_eq!(writes, 1, "one status write for one new Uuid");
    wait_for("three more resyncs", T, || async {
        Ok((op.counter(series).await? >= before + 3).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(
        op.counter("capstan_status_writes_total{plugin=\"uuid\"}")
            .await
            .unwrap(),
        1,
        "an unchanged reconcile writes no status"
    );
    let rv = get(&client, &ns.name, &uuid_ar(), "first")
        .await
        .unwrap()
        .metadata
        .resource_version;
    assert_eq!(
        rv, obj.metadata.resource_version,
        "the object was not written again"
    );

    // Restart (a crash, SIGKILL): the new process reconciles and keeps the UUID.
    op.restart().await;
    wait_for("a reconcile after restart", T, || async {
        Ok((op.counter(series).await? >= 1).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(
        uuid_of(&get(&client, &ns.name, &uuid_ar(), "first").await.unwrap()),
        uuid
    );

    // Hot reload: another build of the plugin replaces the file; the UUID stays.
    let file = op.plugins.path().join("uuid.wasm");
    let new_bytes = std::fs::read(uuid_other_build()).unwrap();
    let new_sha = sha256(&new_bytes);
    std::fs::write(&file, &new_bytes).unwrap();
    wait_for("the new version to serve", T, || async {
        let states = op.plugin_states().await?;
        Ok(states
            .iter()
            .any(|s| s["sha256"] == new_sha.as_str() && s["serving"] == true)
            .then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let after_reload = op.counter(series).await.unwrap();
    wait_for("reconciles by the new version", T, || async {
        Ok((op.counter(series).await? > after_reload).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(
        uuid_of(&get(&client, &ns.name, &uuid_ar(), "first").await.unwrap()),
        uuid
    );
}

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn configmaps(client: &Client, ns: &str) -> Vec<ConfigMap> {
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels("capstan.dev/plugin=widget"))
        .await
        .unwrap()
        .items
}

fn names(cms: &[ConfigMap]) -> Vec<String> {
    let mut n: Vec<String> = cms.iter().filter_map(|c| c.metadata.name.clone()).collect();
    n.sort();
    n
}

#[tokio::test]
async fn children_are_applied_restored_pruned_and_garbage_collected() {
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "children").await;
    let op = Operator::start(&ns.name, &[&test_plugin("widget")], &[]).await;
    let parent = create(
        &client,
        &ns.name,
        &widget_ar(),
        "w",
        json!({"count": 3, "service": true, "message": "hello"}),
    )
    .await;
    let uid = parent.metadata.uid.clone().unwrap();

    let cms = wait_for("three ConfigMaps", T, || async {
        let cms = configmaps(&client, &ns.name).await;
        Ok((cms.len() == 3).then_some(cms))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    assert_eq!(names(&cms), ["w-0", "w-1", "w-2"]);
    for cm in &cms {
        let owner = &cm.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.uid.as_str(), owner.controller, owner.kind.as_str()),
            (uid.as_str(), Some(true), "Widget")
        );
        assert_eq!(
            cm.metadata.labels.as_ref().unwrap()["app.kubernetes.io/managed-by"],
            "capstan"
        );
        assert_eq!(cm.data.as_ref().unwrap()["message"], "hello");
    }
    let svc = Api::<Service>::namespaced(client.clone(), &ns.name)
        .get("w")
        .await
        .unwrap();
    assert_eq!(svc.metadata.owner_references.unwrap()[0].uid, uid);
    await_status(&client, &ns.name, &widget_ar(), "w", "Ready=True", |o| {
        ready(o) == Some(("True".into(), "Reconciled".into()))
    })
    .await;

    // A child edited by hand is restored.
    let cm_api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    cm_api
        .patch(
            "w-1",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"message": "tampered"}})),
        )
        .await
        .unwrap();
    wait_for("w-1 restored", T, || async {
        let cm = cm_api.get("w-1").await?;
        Ok((cm.data.unwrap_or_default()["message"] == "hello").then_some(()))
    })
    .await
    .unwrap();

    // A child deleted by hand is recreated (a new object, with a new UID).
    let old_uid = cm_api.get("w-2").await.unwrap().metadata.uid;
    cm_api
        .delete("w-2", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("w-2 recreated", T, || async {
        Ok(match cm_api.get_opt("w-2").await? {
            Some(cm) if cm.metadata.uid != old_uid => Some(()),
            _ => None,
        })
    })
    .await
    .unwrap();

    // Lowering the count prunes the extra children.
    patch_spec(&client, &ns.name, &widget_ar(), "w", json!({"count": 1})).await;
    wait_for("pruned to one ConfigMap", T, || async {
        Ok((names(&configmaps(&client, &ns.name).await) == ["w-0"]).then_some(()))
    })
    .await
    .unwrap();

    // Deleting the parent garbage-collects the children (the controller-manager's GC).
    Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &widget_ar())
        .delete("w", &DeleteParams::foreground())
        .await
        .unwrap();
    wait_for("children garbage-collected", T, || async {
        let svc = Api::<Service>::namespaced(client.clone(), &ns.name)
            .get_opt("w")
            .await?;
        Ok((configmaps(&client, &ns.name).await.is_empty() && svc.is_none()).then_some(()))
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_finalizer_holds_deletion_until_finalize_is_done() {
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "finalizer").await;
    let op = Operator::start(&ns.name, &[&test_plugin("guard")], &[]).await;
    create(
        &client,
        &ns.name,
        &guard_ar(),
        "g",
        json!({"release": false}),
    )
    .await;
    await_status(
        &client,
        &ns.name,
        &guard_ar(),
        "g",
        "finalizer and status",
        |o| {
            o.metadata
                .finalizers
                .iter()
                .flatten()
                .any(|f| f == "capstan.dev/finalizer")
                && o.data.pointer("/status/guarding") == Some(&json!(true))
        },
    )
    .await;
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &guard_ar());
    api.delete("g", &DeleteParams::default()).await.unwrap();
    // The plugin says "not done": the object stays, marked for deletion.
    holds_for("the Guard to be held", Duration::from_secs(4), || async {
        Ok(api.get("g").await?.metadata.deletion_timestamp.is_some())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    patch_spec(
        &client,
        &ns.name,
        &guard_ar(),
        "g",
        json!({"release": true}),
    )
    .await;
    wait_for("the Guard to be gone", T, || async {
        Ok(api.get_opt("g").await?.is_none().then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
}

#[tokio::test]
async fn refused_output_applies_nothing_and_is_reported() {
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "refused").await;
    let op = Operator::start(&ns.name, &[&test_plugin("widget")], &[]).await;
    create(&client, &ns.name, &widget_ar(), "w", json!({"count": 2})).await;
    wait_for("two ConfigMaps", T, || async {
        Ok((configmaps(&client, &ns.name).await.len() == 2).then_some(()))
    })
    .await
    .unwrap();

    let w = Parent {
        client: &client,
        ns: &ns.name,
        ar: widget_ar(),
        name: "w",
    };

    // An undeclared kind: nothing applied (no Secret), nothing pruned, Ready=False.
    w.patch_spec(json!({"mode": "undeclared-kind", "count": 0}))
        .await;
    let obj = w.await_ready("False", "InvalidPluginOutput").await;
    let message = ready_message(&obj);
    assert!(
        message.contains("Secret.v1 \"w-secret\" is of a kind the plugin did not declare"),
        "{message}"
    );
    assert_eq!(
        configmaps(&client, &ns.name).await.len(),
        2,
        "no child pruned"
    );
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns.name);
    assert!(secrets.get_opt("w-secret").await.unwrap().is_none());
    w.await_warning("InvalidPluginOutput").await;

    // Another namespace: refused the same way; nothing appears in kube-system.
    w.patch_spec(json!({"mode": "other-namespace"})).await;
    let obj = await_status(
        &client,
        &ns.name,
        &w.ar,
        "w",
        "refusal of another namespace",
        |o| ready_message(o).contains("kube-system"),
    )
    .await;
    assert_eq!(ready(&obj).unwrap().1, "InvalidPluginOutput");
    let system = Api::<ConfigMap>::namespaced(client.clone(), "kube-system");
    assert!(system.get_opt("w-elsewhere").await.unwrap().is_none());

    // An invalid spec (the plugin's own verdict): Ready=False InvalidSpec and a Warning.
    w.patch_spec(json!({"mode": "invalid"})).await;
    w.await_ready("False", "InvalidSpec").await;
    w.await_warning("InvalidSpec").await;

    // A plugin that runs past its deadline: Ready=False PluginFailed, host keeps going.
    w.patch_spec(json!({"mode": "loop"})).await;
    w.await_ready("False", "PluginFailed").await;

    // Fixed spec: back to Ready=True, children as asked.
    w.patch_spec(json!({"mode": "", "count": 1})).await;
    w.await_ready("True", "Reconciled").await;
    wait_for("one ConfigMap", T, || async {
        Ok((names(&configmaps(&client, &ns.name).await) == ["w-0"]).then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
}

/// One parent object under test.
struct Parent<'a> {
    client: &'a Client,
    ns: &'a str,
    ar: ApiResource,
    name: &'a str,
}

impl Parent<'_> {
    async fn patch_spec(&self, spec: Value) {
        patch_spec(self.client, self.ns, &self.ar, self.name, spec).await;
    }

    /// Waits for the `Ready` condition to have `status` and `reason`.
    async fn await_ready(&self, status: &str, reason: &str) -> DynamicObject {
        let want = Some((status.to_string(), reason.to_string()));
        await_status(
            self.client,
            self.ns,
            &self.ar,
            self.name,
            &format!("Ready={status} {reason}"),
            |o| ready(o) == want,
        )
        .await
    }

    /// Waits for a Warning event with `reason` on the parent.
    async fn await_warning(&self, reason: &str) {
        wait_for(&format!("a Warning event {reason}"), T, || async {
            let events = warning_events(self.client, self.ns, self.name, reason).await;
            Ok((!events.is_empty()).then_some(()))
        })
        .await
        .unwrap();
    }
}

fn ready_message(obj: &DynamicObject) -> String {
    let conditions = obj
        .data
        .pointer("/status/conditions")
        .and_then(Value::as_array);
    conditions
        .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_string()
}

fn state_of<'a>(states: &'a [Value], file: &str) -> Option<&'a Value> {
    states
        .iter()
        .find(|s| s["file"].as_str().is_some_and(|f| f.ends_with(file)))
}

/// `/readyz` (what a Deployment's readiness probe and a rollout wait for) is ok only once
/// every plugin file present at start is loaded, also files written a moment before the
/// start (as the init container that seeds the plugin directory writes them).
#[tokio::test]
async fn ready_only_once_every_plugin_file_is_loaded() {
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "readyz").await;
    // start() copies the files into a new directory and returns once /readyz is ok. An
    // empty compile cache makes loading take seconds (compiling PostgreSQL's plugin),
    // so a /readyz that does not wait for it is seen.
    let cache = tempfile::tempdir().unwrap();
    let op = Operator::start(
        &ns.name,
        &[&plugin("uuid"), &plugin("postgresql")],
        &["--cache-dir", cache.path().to_str().unwrap()],
    )
    .await;
    let states = op.plugin_states().await.unwrap();
    for file in ["uuid.wasm", "postgresql.wasm"] {
        let state = state_of(&states, file);
        assert!(
            state.is_some_and(|s| s["serving"] == true),
            "{file} is not serving when /readyz is ok: {states:?}"
        );
    }
}

#[tokio::test]
async fn the_plugin_directory_is_live() {
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "plugdir").await;
    let op = Operator::start(&ns.name, &[], &[]).await;
    let dir = op.plugins.path().to_path_buf();
    assert!(op.plugin_states().await.unwrap().is_empty());

    // Add: a file dropped in while running is loaded and its kind reconciled.
    std::fs::copy(plugin("uuid"), dir.join("uuid.wasm")).unwrap();
    create(&client, &ns.name, &uuid_ar(), "a", json!({})).await;
    let a = await_status(
        &client,
        &ns.name,
        &uuid_ar(),
        "a",
        "status.uuid of a",
        |o| !uuid_of(o).is_empty(),
    )
    .await;

    // Duplicate kind: a second file claiming Uuid is refused, naming both files.
    std::fs::copy(plugin("uuid"), dir.join("uuid2.wasm")).unwrap();
    let err = wait_for("the duplicate to be refused", T, || async {
        let states = op.plugin_states().await?;
        Ok(state_of(&states, "uuid2.wasm").and_then(|s| s["error"].as_str().map(String::from)))
    })
    .await
    .unwrap();
    assert!(
        err.contains("uuid.wasm and")
            && err.contains("uuid2.wasm both reconcile Uuid.demo.operator/v1"),
        "{err}"
    );
    std::fs::remove_file(dir.join("uuid2.wasm")).unwrap();

    // Replace with a broken file: the old version keeps serving, the failure is visible.
    let good_sha =
        state_of(&op.plugin_states().await.unwrap(), "uuid.wasm").unwrap()["sha256"].clone();
    std::fs::write(dir.join("uuid.wasm"), b"\0asm\x0d\0\x01\0 truncated").unwrap();
    let state = wait_for("the broken file to be reported", T, || async {
        let states = op.plugin_states().await?;
        Ok(state_of(&states, "uuid.wasm")
            .filter(|s| s["error"].is_string())
            .cloned())
    })
    .await
    .unwrap();
    assert_eq!(state["serving"], true);
    assert_eq!(state["sha256"], good_sha, "the old version still serves");
    create(&client, &ns.name, &uuid_ar(), "b", json!({})).await;
    await_status(
        &client,
        &ns.name,
        &uuid_ar(),
        "b",
        "b reconciled by the old version",
        |o| !uuid_of(o).is_empty(),
    )
    .await;
    assert!(
        op.log().contains("plugin not loaded"),
        "the failure is logged"
    );

    // Replace with a good new version: swapped in.
    let new_bytes = std::fs::read(uuid_other_build()).unwrap();
    std::fs::write(dir.join("uuid.wasm"), &new_bytes).unwrap();
    wait_for("the new version to serve", T, || async {
        let states = op.plugin_states().await?;
        Ok(state_of(&states, "uuid.wasm")
            .filter(|s| s["sha256"] == sha256(&new_bytes).as_str() && s["error"].is_null())
            .map(|_| ()))
    })
    .await
    .unwrap();

    // Remove: the controller stops and touches no resource.
    std::fs::remove_file(dir.join("uuid.wasm")).unwrap();
    wait_for("the plugin to be gone", T, || async {
        Ok(op.plugin_states().await?.is_empty().then_some(()))
    })
    .await
    .unwrap();
    create(&client, &ns.name, &uuid_ar(), "c", json!({})).await;
    holds_for(
        "c to stay unreconciled and a to keep its UUID",
        Duration::from_secs(3),
        || async {
            let c = get(&client, &ns.name, &uuid_ar(), "c").await?;
            let a_now = get(&client, &ns.name, &uuid_ar(), "a").await?;
            Ok(c.data.get("status").is_none() && uuid_of(&a_now) == uuid_of(&a))
        },
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn with_leader_election_one_replica_reconciles_and_another_takes_over() {
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "leader").await;
    let election = [
        "--leader-elect",
        "--leader-election-namespace",
        &ns.name,
        "--lease-duration-seconds",
        "3",
    ];
    let mut first = Operator::start(&ns.name, &[&plugin("uuid")], &election).await;
    wait_for("the first replica to lead", T, || async {
        Ok((first.counter("capstan_leader").await? == 1).then_some(()))
    })
    .await
    .unwrap();
    let second = Operator::start(&ns.name, &[&plugin("uuid")], &election).await;
    create(&client, &ns.name, &uuid_ar(), "a", json!({})).await;
    await_status(&client, &ns.name, &uuid_ar(), "a", "a reconciled", |o| {
        !uuid_of(o).is_empty()
    })
    .await;
    let series = "capstan_reconciles_total{plugin=\"uuid\",result=\"ok\"}";
    assert!(first.counter(series).await.unwrap() >= 1);
    assert_eq!(second.counter("capstan_leader").await.unwrap(), 0);
    assert_eq!(
        second.counter(series).await.unwrap(),
        0,
        "the standby reconciles nothing"
    );

    // The leader dies without releasing the lease: the standby takes over once it expires.
    first.kill();
    create(&client, &ns.name, &uuid_ar(), "b", json!({})).await;
    await_status(
        &client,
        &ns.name,
        &uuid_ar(),
        "b",
        "b reconciled by the new leader",
        |o| !uuid_of(o).is_empty(),
    )
    .await;
    assert_eq!(second.counter("capstan_leader").await.unwrap(), 1);
    assert!(second.counter(series).await.unwrap() >= 1);
}
