//! Plugins from an OCI registry under `capstan run --verify-key` against the local
//! control plane and a real registry (`crane registry serve`, see
//! `capstan_e2e::registry`): the Uuid plugin named by `--plugin oci://…:stable`, the
//! Widget plugin by a reference file `widget.oci` in the plugin directory, both pushed
//! signed with `capstan push --sign-key`, both serve; `widget.next.oci` shadows
//! `widget.oci`. The tag moved to an unsigned build
//! is refused while the signed version keeps serving; moved to a signed build, it is a
//! new version, loaded. A plugin file of the directory is refused unsigned and served
//! once `capstan sign` wrote its signature.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use capstan_e2e::objects::{create_object, ready_condition, test_kind, uuid_kind};
use capstan_e2e::operator::{Operator, capstan_bin, plugin, root, test_plugin, uuid_other_build};
use capstan_e2e::registry::Registry;
use capstan_e2e::{TestNamespace, client, wait_for};
use kube::api::{Api, DynamicObject};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const T: Duration = Duration::from_secs(60);

fn key(name: &str) -> PathBuf {
    root().join("host/tests/fixtures/keys").join(name)
}

fn sha256(file: &Path) -> String {
    format!("{:x}", Sha256::digest(std::fs::read(file).unwrap()))
}

/// `capstan ARGS`, which must succeed.
fn capstan(args: &[&str]) {
    let out = Command::new(capstan_bin()).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "capstan {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Pushes `file` to `repository:tag`, signed with the test key or not.
fn push(registry: &Registry, file: &Path, repository_tag: &str, signed: bool) {
    let reference = registry.reference(repository_tag);
    let signer = key("signer.key");
    let mut args = vec![
        "push",
        file.to_str().unwrap(),
        &reference,
        "--oci-plain-http",
        &registry.address,
    ];
    if signed {
        args.extend(["--sign-key", signer.to_str().unwrap()]);
    }
    capstan(&args);
}

/// The `/plugins` entry whose file ends with `file`.
async fn state(op: &Operator, file: &str) -> anyhow::Result<Option<Value>> {
    Ok(op
        .plugin_states()
        .await?
        .into_iter()
        .find(|s| s["file"].as_str().is_some_and(|f| f.ends_with(file))))
}

#[tokio::test]
async fn signed_plugins_from_a_registry_serve_and_a_moved_tag_is_a_new_version_once_signed() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "oci").await;
    let registry = Registry::start().unwrap();
    push(&registry, &plugin("uuid"), "plugins/uuid:stable", true);
    push(&registry, &test_plugin("widget"), "plugins/widget:1", true);
    let uuid_ref = registry.reference("plugins/uuid:stable");
    let verify = key("signer.pub");
    let op = Operator::start(
        &ns.name,
        &[],
        &[
            "--plugin",
            &uuid_ref,
            "--verify-key",
            verify.to_str().unwrap(),
            "--oci-plain-http",
            &registry.address,
            "--oci-refresh-seconds",
            "1",
        ],
    )
    .await;
    let fail = |e: anyhow::Error| -> ! { panic!("{e}\n{}", op.log_tail()) };
    std::fs::write(
        op.plugins.path().join("widget.oci"),
        format!(
            "# the Widget plugin\n{}\n",
            registry.reference("plugins/widget:1")
        ),
    )
    .unwrap();

    // Both serve, each the bytes pushed.
    for (file, built) in [
        (uuid_ref.as_str(), plugin("uuid")),
        ("/widget.oci", test_plugin("widget")),
    ] {
        wait_for(&format!("{file} serving"), T, || async {
            Ok(state(&op, file).await?.filter(|s| {
                s["serving"] == true
                    && s["sha256"] == sha256(&built).as_str()
                    && s["error"].is_null()
            }))
        })
        .await
        .unwrap_or_else(|e| fail(e));
    }
    let uuids = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &uuid_kind());
    let widgets = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        &ns.name,
        &test_kind("Widget", "widgets"),
    );
    create_object(&uuids, &uuid_kind(), "u1", json!({})).await;
    create_object(
        &widgets,
        &test_kind("Widget", "widgets"),
        "w1",
        json!({"count": 1}),
    )
    .await;
    wait_for("u1 reconciled by the pulled plugin", T, || async {
        Ok(uuids
            .get("u1")
            .await?
            .data
            .pointer("/status/uuid")
            .map(|_| ()))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    wait_for(
        "w1 Ready by the plugin its reference file names",
        T,
        || async {
            let ready = ready_condition(&widgets.get("w1").await?).map(|c| c.0);
            Ok((ready.as_deref() == Some("True")).then_some(()))
        },
    )
    .await
    .unwrap_or_else(|e| fail(e));

    // A new version named in `widget.next.oci` is the shadow of `widget.oci`, pulled and
    // verified the same way, called beside each reconcile and never applied.
    push(
        &registry,
        &test_plugin("widget-rebuilt"),
        "plugins/widget:2",
        true,
    );
    std::fs::write(
        op.plugins.path().join("widget.next.oci"),
        registry.reference("plugins/widget:2"),
    )
    .unwrap();
    let shadow_of = || async {
        Ok::<_, anyhow::Error>(
            state(&op, "/widget.oci")
                .await?
                .map(|s| s["shadow"].clone())
                .filter(|shadow| {
                    shadow["sha256"] == sha256(&test_plugin("widget-rebuilt")).as_str()
                }),
        )
    };
    wait_for(
        "widget.next.oci loaded as the shadow of widget.oci",
        T,
        shadow_of,
    )
    .await
    .unwrap_or_else(|e| fail(e));
    // A reconcile, which the shadow answers too.
    widgets
        .patch(
            "w1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"count": 2}})),
        )
        .await
        .unwrap();
    let shadow = wait_for("the shadow to agree on a reconcile", T, || async {
        Ok(shadow_of()
            .await?
            .filter(|shadow| shadow["agreed"].as_u64().unwrap_or_default() > 0))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    assert!(
        shadow["file"]
            .as_str()
            .unwrap_or_default()
            .ends_with("widget.next.oci"),
        "{shadow}"
    );
    let serving = state(&op, "/widget.oci").await.unwrap().unwrap();
    assert_eq!(serving["sha256"], sha256(&test_plugin("widget")).as_str());

    // The tag moves to a build nobody signed: refused, the signed version serves on.
    push(&registry, &uuid_other_build(), "plugins/uuid:stable", false);
    let refused = wait_for("the unsigned build refused", T, || async {
        Ok(state(&op, &uuid_ref).await?.filter(|s| {
            s["error"]
                .as_str()
                .is_some_and(|e| e.contains("refused: no signature"))
        }))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    assert_eq!(refused["serving"], true, "{refused}");
    assert_eq!(
        refused["sha256"],
        sha256(&plugin("uuid")).as_str(),
        "{refused}"
    );
    create_object(&uuids, &uuid_kind(), "u2", json!({})).await;
    wait_for("u2 reconciled by the version still serving", T, || async {
        Ok(uuids
            .get("u2")
            .await?
            .data
            .pointer("/status/uuid")
            .map(|_| ()))
    })
    .await
    .unwrap_or_else(|e| fail(e));

    // Signed: the new digest is a new version, loaded; the refusal is gone.
    push(&registry, &uuid_other_build(), "plugins/uuid:stable", true);
    wait_for("the signed new build serving", T, || async {
        Ok(state(&op, &uuid_ref).await?.filter(|s| {
            s["serving"] == true
                && s["sha256"] == sha256(&uuid_other_build()).as_str()
                && s["error"].is_null()
        }))
    })
    .await
    .unwrap_or_else(|e| fail(e));

    // A file of the directory, unsigned: refused; signed by `capstan sign`: served.
    let file = op.plugins.path().join("ticket.wasm");
    std::fs::copy(test_plugin("ticket"), &file).unwrap();
    wait_for("the unsigned file refused", T, || async {
        Ok(state(&op, "/ticket.wasm").await?.filter(|s| {
            s["serving"] == false
                && s["error"].as_str().is_some_and(|e| {
                    e.contains("refused: unsigned (no") && e.contains("ticket.wasm.sig")
                })
        }))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    capstan(&[
        "sign",
        file.to_str().unwrap(),
        "--key",
        key("signer.key").to_str().unwrap(),
    ]);
    wait_for("the signed file serving", T, || async {
        Ok(state(&op, "/ticket.wasm")
            .await?
            .filter(|s| s["serving"] == true && s["error"].is_null()))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    assert!(
        op.log().contains("refused: no signature"),
        "the refusal is logged: {}",
        op.log_tail()
    );
}

#[tokio::test]
async fn under_canary_a_moved_tag_is_a_candidate_rolled_back_when_broken_promoted_when_healthy() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "oci-canary").await;
    let registry = Registry::start().unwrap();
    push(
        &registry,
        &test_plugin("widget"),
        "plugins/widget:live",
        false,
    );
    let op = Operator::start(
        &ns.name,
        &[],
        &[
            "--canary",
            "--canary-steps",
            "50,100",
            "--canary-step-seconds",
            "3",
            "--canary-min-reconciles",
            "3",
            "--oci-plain-http",
            &registry.address,
            "--oci-refresh-seconds",
            "1",
        ],
    )
    .await;
    let fail = |e: anyhow::Error| -> ! { panic!("{e}\n{}", op.log_tail()) };
    std::fs::write(
        op.plugins.path().join("widget.oci"),
        registry.reference("plugins/widget:live"),
    )
    .unwrap();
    let serving_sha = |built: PathBuf| {
        let op = &op;
        async move {
            wait_for(&format!("{} serving", built.display()), T, || async {
                Ok(state(op, "/widget.oci")
                    .await?
                    .filter(|s| s["serving"] == true && s["sha256"] == sha256(&built).as_str()))
            })
            .await
        }
    };
    serving_sha(test_plugin("widget"))
        .await
        .unwrap_or_else(|e| fail(e));
    let kind = test_kind("Widget", "widgets");
    let widgets = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &kind);
    let names: Vec<String> = (0..12).map(|i| format!("w-{i:02}")).collect();
    for name in &names {
        create_object(&widgets, &kind, name, json!({"count": 1})).await;
    }
    let all_ready = || async {
        wait_for("every Widget Ready", T, || async {
            for name in &names {
                let ready = ready_condition(&widgets.get(name).await?).map(|c| c.0);
                if ready.as_deref() != Some("True") {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        })
        .await
    };
    all_ready().await.unwrap_or_else(|e| fail(e));

    // The tag moves to the broken build: a candidate, not a replacement; rolled back.
    push(
        &registry,
        &test_plugin("widget-broken"),
        "plugins/widget:live",
        false,
    );
    let rolled_back = wait_for("the broken digest rolled back", T, || async {
        let canary = op.canary_state("widget").await?;
        Ok((canary["phase"] == "rolled-back").then_some(canary))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    assert_eq!(
        rolled_back["sha256"],
        sha256(&test_plugin("widget-broken")).as_str(),
        "{rolled_back}"
    );
    serving_sha(test_plugin("widget"))
        .await
        .unwrap_or_else(|e| fail(e));
    all_ready().await.unwrap_or_else(|e| fail(e));

    // Then to a healthy new build: stepped up to every parent, promoted, and from then
    // on the version the reference serves, with no candidate left.
    push(
        &registry,
        &test_plugin("widget-rebuilt"),
        "plugins/widget:live",
        false,
    );
    serving_sha(test_plugin("widget-rebuilt"))
        .await
        .unwrap_or_else(|e| fail(e));
    assert!(
        op.log().contains("canary: the candidate is promoted"),
        "{}",
        op.log_tail()
    );
    assert!(
        op.canary_state("widget").await.unwrap().is_null(),
        "no candidate left"
    );
    assert_eq!(
        op.counter("capstan_canary_rollbacks_total{plugin=\"widget\"}")
            .await
            .unwrap(),
        1
    );
    all_ready().await.unwrap_or_else(|e| fail(e));
}
