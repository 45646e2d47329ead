//! The Helm chart deploy/helm/capstan. Without a cluster: it renders the objects of the
//! kustomize manifests, object by object and field by field (deploy/ with the default
//! values, deploy/sharded/ with `sharding.enabled`), its copies of generated files are
//! current, and `helm lint --strict` passes. With the cluster: the API server accepts
//! what it renders, and installed on the real node its Capstan Pod becomes Ready,
//! reconciles, and goes away with `helm uninstall`.
//!
//! `helm` and `kubectl` come from the binaries cache (`cargo xtask test` names them in
//! CAPSTAN_HELM and CAPSTAN_KUBECTL); without them every test here fails, none skips.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use capstan_e2e::node::point_postgresql_conversion_at_the_service;
use capstan_e2e::objects::uuid_kind;
use capstan_e2e::operator::{http_get, root};
use capstan_e2e::{TestNamespace, client, wait_for};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, LogParams, PostParams};
use serde::Deserialize;
use serde_yaml_ng::Value;

/// The chart, under the workspace root.
const CHART: &str = "deploy/helm/capstan";
/// The release and namespace deploy/ is written for.
const RELEASE: &str = "capstan";
const NAMESPACE: &str = "capstan-system";
/// The crate's version: the chart's version and appVersion, and the image tag.
const VERSION: &str = env!("CARGO_PKG_VERSION");

// ---------------------------------------------------------------------------------------
// Without a cluster.

#[test]
fn default_values_render_the_objects_of_deploy() {
    let helm = helm_template(RELEASE, NAMESPACE, &[]);
    let kustomize = kubectl_kustomize("deploy");
    assert_same_objects(&helm, &kustomize, "helm template (defaults) vs deploy/");
}

#[test]
fn sharding_renders_the_objects_of_deploy_sharded() {
    let helm = helm_template(RELEASE, NAMESPACE, &["--set", "sharding.enabled=true"]);
    let kustomize = kubectl_kustomize("deploy/sharded");
    assert_same_objects(
        &helm,
        &kustomize,
        "helm template (sharding.enabled=true) vs deploy/sharded/",
    );
}

#[test]
fn chart_version_is_the_crate_version_and_its_copies_are_current() {
    let chart: Value = serde_yaml_ng::from_str(&read(&root().join(CHART).join("Chart.yaml")))
        .expect("Chart.yaml is YAML");
    assert_eq!(
        chart["version"].as_str(),
        Some(VERSION),
        "Chart.yaml version"
    );
    assert_eq!(
        chart["appVersion"].as_str(),
        Some(VERSION),
        "Chart.yaml appVersion"
    );
    // Helm reads CRDs from the chart's crds/ and nothing outside the chart, so these are
    // copies (links would point out of the chart, which GitOps tools refuse).
    let copies = [
        ("crds/uuid.yaml", "crds/uuid.yaml"),
        ("crds/postgresqlcluster.yaml", "crds/postgresqlcluster.yaml"),
        ("crds/database.yaml", "crds/database.yaml"),
        ("files/clusterrole.yaml", "deploy/base/clusterrole.yaml"),
        (
            "files/plugin-identities.yaml",
            "deploy/base/plugin-identities.yaml",
        ),
    ];
    for (copy, original) in copies {
        assert_eq!(
            read(&root().join(CHART).join(copy)),
            read(&root().join(original)),
            "{CHART}/{copy} is not a copy of {original}: `cp {original} {CHART}/{copy}`"
        );
    }
    let shipped: BTreeSet<String> = std::fs::read_dir(root().join("crds"))
        .expect("read crds/")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    let copied: BTreeSet<String> = copies
        .iter()
        .filter_map(|(copy, _)| copy.strip_prefix("crds/").map(str::to_owned))
        .collect();
    assert_eq!(
        shipped, copied,
        "every CRD of crds/ has its copy in the chart"
    );
}

#[test]
fn helm_lint_passes_strictly() {
    for values in [&[][..], &["--set", "sharding.enabled=true"][..]] {
        let out = output(
            helm()
                .args(["lint", "--strict"])
                .arg(root().join(CHART))
                .args(values),
            None,
        );
        assert!(
            out.contains("0 chart(s) failed"),
            "helm lint {values:?}:\n{out}"
        );
    }
}

#[test]
fn another_release_gets_names_leases_and_plugin_limits_of_its_own() {
    let values = values_file(&serde_json::json!({
        "watchNamespace": "team-a",
        "extraArgs": ["--concurrency=8"],
        "plugins": {"limits": {"postgresql": {"timeout-ms": 500, "cpu": 0.25}}},
        "nodeSelector": {"kubernetes.io/hostname": "node-a"},
    }));
    let path = values.path().to_str().unwrap();
    for sharded in [false, true] {
        let sharding = format!("sharding.enabled={sharded}");
        let yaml = helm_template("other", "team", &["-f", path, "--set", &sharding]);
        let objects = objects(&yaml, "helm template");
        let get = |kind: &str, ns: &str, name: &str| {
            objects
                .get(&key(kind, ns, name))
                .unwrap_or_else(|| panic!("no {kind} {ns}/{name} in:\n{yaml}"))
        };
        // Names are the release's, so that two releases do not share cluster-scoped
        // objects, the Lease, or the shard group.
        let deployment = get("Deployment", "team", "other-capstan");
        let pod = &deployment["spec"]["template"]["spec"];
        let args: Vec<&str> = pod["containers"][0]["args"]
            .as_sequence()
            .expect("args")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let own = match sharded {
            true => ["--shards", "--shard-group=other-capstan"],
            false => ["--leader-elect", "--leader-election-id=other-capstan"],
        };
        for arg in own.iter().chain(&["--namespace=team-a", "--concurrency=8"]) {
            assert!(args.contains(arg), "{arg} missing from {args:?}");
        }
        assert_eq!(pod["nodeSelector"]["kubernetes.io/hostname"], "node-a");
        let binding = get("ClusterRoleBinding", "", "other-capstan");
        assert_eq!(binding["subjects"][0]["namespace"], "team");
        assert_eq!(binding["roleRef"]["name"], "other-capstan");
        // Each plugin's identity: its account in the release's namespace, its role and
        // binding named after the release; the host impersonates the accounts there.
        for plugin in ["uuid", "postgresql", "database"] {
            get(
                "ServiceAccount",
                "team",
                &format!("capstan-plugin-{plugin}"),
            );
            let role = format!("other-capstan-plugin-{plugin}");
            get("ClusterRole", "", &role);
            let binding = get("ClusterRoleBinding", "", &role);
            assert_eq!(binding["roleRef"]["name"], role.as_str());
            assert_eq!(binding["subjects"][0]["namespace"], "team");
            assert_eq!(
                binding["subjects"][0]["name"],
                format!("capstan-plugin-{plugin}").as_str()
            );
        }
        let impersonation = get("RoleBinding", "team", "other-capstan-impersonate-plugins");
        assert_eq!(impersonation["subjects"][0]["name"], "other-capstan");
        assert_eq!(impersonation["subjects"][0]["namespace"], "team");
        get("Role", "team", "other-capstan-impersonate-plugins");
        let identities = pod["containers"][0]["env"]
            .as_sequence()
            .expect("env")
            .iter()
            .find(|e| e["name"] == "CAPSTAN_PLUGIN_IDENTITIES")
            .expect("CAPSTAN_PLUGIN_IDENTITIES in the env");
        assert_eq!(
            identities["valueFrom"]["fieldRef"]["fieldPath"],
            "metadata.namespace"
        );
        // It may read and patch the ValidatingWebhookConfiguration its host writes
        // (--webhook-configuration=other-capstan), not the default release's.
        let role = get("ClusterRole", "", "other-capstan");
        let named: Vec<&Value> = role["rules"]
            .as_sequence()
            .expect("rules")
            .iter()
            .filter(|r| {
                r["resources"]
                    .as_sequence()
                    .is_some_and(|v| v.iter().any(|x| x == "validatingwebhookconfigurations"))
                    && !r["resourceNames"].is_null()
            })
            .collect();
        assert_eq!(named.len(), 1, "{:?}", role["rules"]);
        assert_eq!(
            named[0]["resourceNames"],
            serde_yaml_ng::from_str::<Value>("[other-capstan]").unwrap()
        );
        assert!(
            args.contains(&"--webhook-configuration=other-capstan"),
            "{args:?}"
        );
        // And reads only its own ClusterRole, which owns that configuration.
        let owner = role["rules"]
            .as_sequence()
            .expect("rules")
            .iter()
            .find(|r| r["resources"][0] == "clusterroles")
            .expect("get on its ClusterRole");
        assert_eq!(
            owner["resourceNames"],
            serde_yaml_ng::from_str::<Value>("[other-capstan]").unwrap()
        );
        assert!(
            args.contains(&"--webhook-owner-clusterrole=other-capstan"),
            "{args:?}"
        );
        get("Service", "team", "other-capstan-metrics");
        assert_eq!(
            objects.contains_key(&key("Role", "team", "other-capstan-shards")),
            sharded,
            "the shards Role exists exactly when sharding is on"
        );
        // The limits file lands beside the plugin, and a change of it rolls the Pods.
        let limits = get("ConfigMap", "team", "other-capstan-plugin-limits");
        let toml = limits["data"]["postgresql.toml"]
            .as_str()
            .unwrap_or_default();
        assert!(
            toml.contains("timeout-ms = 500") && toml.contains("cpu = 0.25"),
            "{toml}"
        );
        let mounts = pod["containers"][0]["volumeMounts"]
            .as_sequence()
            .expect("volumeMounts");
        assert!(
            mounts
                .iter()
                .any(|m| m["mountPath"] == "/plugins/postgresql.toml"
                    && m["subPath"] == "postgresql.toml"),
            "{mounts:?}"
        );
        let annotations = &deployment["spec"]["template"]["metadata"]["annotations"];
        assert!(
            annotations["checksum/plugin-limits"].as_str().is_some(),
            "{annotations:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// With the cluster.

#[tokio::test]
async fn rendered_chart_is_accepted_by_the_api_server() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "helm-dry").await;
    point_postgresql_conversion_at_the_service();
    let other = values_file(&serde_json::json!({
        "plugins": {"limits": {"postgresql": {"timeout-ms": 500}}},
        "extraArgs": ["--concurrency=8"],
        "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}],
    }));
    let other = ["-f", other.path().to_str().unwrap()];
    for values in [&[][..], &["--set", "sharding.enabled=true"][..], &other[..]] {
        let yaml = helm_template("capstan-dry", &ns.name, values);
        let rendered = objects(&yaml, "helm template");
        let out = output(
            kubectl().args(["apply", "--dry-run=server", "-f", "-"]),
            Some(&yaml),
        );
        // One line per object, e.g. `deployment.apps/capstan-dry created (server dry run)`.
        let accepted = out.lines().filter(|l| l.ends_with("(server dry run)"));
        assert_eq!(
            accepted.count(),
            rendered.len(),
            "every object of {values:?} accepted:\n{out}"
        );
    }
    ns.delete(Duration::from_secs(60)).await.unwrap();
}

/// How long the Pod may take to become Ready: it starts by compiling the plugins.
const READY: Duration = Duration::from_secs(300);
const T: Duration = Duration::from_secs(120);

#[tokio::test]
async fn installed_chart_runs_capstan_on_the_real_node_and_uninstalls_cleanly() {
    let client = client().await;
    let node = real_node(&client).await;
    let image = format!("capstan:{VERSION}");
    wait_for_image(&client, &node, &image).await;

    let ns = TestNamespace::new(&client, "helm").await;
    point_postgresql_conversion_at_the_service();
    let release = "capstan-e2e";
    let hostname = node_hostname(&client, &node).await;
    // One replica, pinned to the real node (a kwok node would report it Ready without
    // running it), serving only this test's namespace, from the imported image only.
    let values = values_file(&serde_json::json!({
        "replicaCount": 1,
        "watchNamespace": ns.name,
        "nodeSelector": {"kubernetes.io/hostname": hostname},
        "image": {"pullPolicy": "Never"},
    }));
    let installed = Release::install(release, &ns.name, values.path());
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    let selector = format!("app.kubernetes.io/instance={release}");

    let ready = wait_for(
        "the Capstan Pod to be Ready on the real node",
        READY,
        || {
            let (pods, selector, node) = (pods.clone(), selector.clone(), node.clone());
            async move {
                let list = pods.list(&ListParams::default().labels(&selector)).await?;
                let [pod] = &list.items[..] else {
                    anyhow::bail!("{} Pods, expected 1", list.items.len());
                };
                let on_node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
                anyhow::ensure!(
                    on_node.is_none() || on_node == Some(node.as_str()),
                    "the Pod was scheduled on {on_node:?}, not the real node {node}"
                );
                Ok(is_ready(pod).then(|| pod.metadata.name.clone().unwrap_or_default()))
            }
        },
    )
    .await;
    let pod = match ready {
        Ok(pod) => pod,
        Err(e) => panic!("{e}\n{}", pod_report(&client, &ns.name, &selector).await),
    };

    // It leads (the leader-election Role works in the cluster) and reconciles a Uuid of
    // its namespace: counted in its own /metrics, so not by any other capstan around.
    let forward = PortForward::start(&ns.name, &pod);
    let uuids = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &uuid_kind());
    let uuid: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "demo.operator/v1", "kind": "Uuid", "metadata": {"name": "from-helm"},
    }))
    .unwrap();
    uuids.create(&PostParams::default(), &uuid).await.unwrap();
    let reconciled = wait_for("the Uuid reconciled by the Pod", T, || {
        let (uuids, port) = (uuids.clone(), forward.port);
        async move {
            let u = uuids.get("from-helm").await?;
            let metrics = http_get(port, "/metrics").await?;
            let ok = series(
                &metrics,
                "capstan_reconciles_total{plugin=\"uuid\",result=\"ok\"}",
            );
            let leads = series(&metrics, "capstan_leader") == Some(1.0);
            let done = u.data.pointer("/status/uuid").is_some() && leads && ok >= Some(1.0);
            Ok(done.then_some(()))
        }
    })
    .await;
    if let Err(e) = reconciled {
        panic!("{e}\n{}", pod_report(&client, &ns.name, &selector).await);
    }
    drop(forward);
    // Gone while capstan still runs, so that no finalizer waits for it.
    uuids
        .delete("from-helm", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the Uuid to be deleted", T, || {
        let uuids = uuids.clone();
        async move { Ok(uuids.get_opt("from-helm").await?.is_none().then_some(())) }
    })
    .await
    .unwrap();

    installed.uninstall();
    wait_for("every object of the release to be gone", T, || {
        let (client, ns, selector) = (client.clone(), ns.name.clone(), selector.clone());
        async move {
            let left = release_objects(&client, &ns, &selector).await?;
            match left.is_empty() {
                true => Ok(Some(())),
                false => anyhow::bail!("left: {}", left.join(", ")),
            }
        }
    })
    .await
    .unwrap();
    ns.delete(T).await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Comparing renderings.

/// (kind, namespace, name): how objects are matched.
type Key = (String, String, String);

fn key(kind: &str, namespace: &str, name: &str) -> Key {
    (kind.into(), namespace.into(), name.into())
}

fn show(key: &Key) -> String {
    match key.1.as_str() {
        "" => format!("{} {}", key.0, key.2),
        ns => format!("{} {ns}/{}", key.0, key.2),
    }
}

/// The objects of a multi-document YAML stream.
fn objects(yaml: &str, source: &str) -> BTreeMap<Key, Value> {
    let mut out = BTreeMap::new();
    for document in serde_yaml_ng::Deserializer::from_str(yaml) {
        let value = Value::deserialize(document)
            .unwrap_or_else(|e| panic!("{source} printed YAML that does not parse: {e}"));
        if value.is_null() {
            continue;
        }
        let field = |path: &[&str]| {
            path.iter()
                .fold(&value, |v, k| &v[*k])
                .as_str()
                .unwrap_or_default()
                .to_owned()
        };
        let key = (
            field(&["kind"]),
            field(&["metadata", "namespace"]),
            field(&["metadata", "name"]),
        );
        assert!(
            !key.0.is_empty() && !key.2.is_empty(),
            "{source}: an object without kind or name: {value:?}"
        );
        if out.insert(key.clone(), value).is_some() {
            panic!("{source}: {} twice", show(&key));
        }
    }
    out
}

/// Labels that name the installing tool: Helm sets them, a kustomize manifest cannot
/// (it is applied by any tool). Removed from the chart's objects after checking them.
fn take_tool_labels(key: &Key, object: &mut Value, problems: &mut Vec<String>) {
    let expected = [
        ("helm.sh/chart", format!("capstan-{VERSION}")),
        ("app.kubernetes.io/managed-by", "Helm".to_owned()),
    ];
    let crd = key.0 == "CustomResourceDefinition";
    let mut places = vec![&["metadata", "labels"][..]];
    if key.0 == "Deployment" {
        places.push(&["spec", "template", "metadata", "labels"]);
    }
    for place in places {
        let labels = place
            .iter()
            .try_fold(&mut *object, |v, k| v.get_mut(*k))
            .and_then(Value::as_mapping_mut);
        let place = place.join(".");
        let Some(labels) = labels else {
            if !crd {
                problems.push(format!("{}: no {place}", show(key)));
            }
            continue;
        };
        for (label, value) in &expected {
            match labels.remove(*label) {
                Some(v) if v.as_str() == Some(value) => {}
                // The chart's CRDs are files that Helm does not template.
                None if crd => {}
                other => problems.push(format!(
                    "{}: {place} {label} is {other:?}, expected {value:?}",
                    show(key)
                )),
            }
        }
    }
}

/// Every difference between two values, one line each, with its path in `at`.
fn differences(at: &str, helm: &Value, kustomize: &Value, out: &mut Vec<String>) {
    match (helm, kustomize) {
        (Value::Mapping(h), Value::Mapping(k)) => {
            let keys: BTreeSet<String> = h.keys().chain(k.keys()).map(compact).collect();
            for name in keys {
                let field = |m: &serde_yaml_ng::Mapping| {
                    m.iter()
                        .find(|(k, _)| compact(k) == name)
                        .map(|(_, v)| v.clone())
                };
                let path = format!("{at}.{}", name.trim_matches('"'));
                match (field(h), field(k)) {
                    (Some(h), Some(k)) => differences(&path, &h, &k, out),
                    (Some(h), None) => {
                        out.push(format!("{path}: only the chart has it ({})", compact(&h)))
                    }
                    (None, Some(k)) => {
                        out.push(format!("{path}: only kustomize has it ({})", compact(&k)))
                    }
                    (None, None) => unreachable!("a key of one of them"),
                }
            }
        }
        (Value::Sequence(h), Value::Sequence(k)) => {
            if h.len() != k.len() {
                out.push(format!(
                    "{at}: {} items in the chart, {} in kustomize",
                    h.len(),
                    k.len()
                ));
            }
            for (i, (h, k)) in h.iter().zip(k).enumerate() {
                differences(&format!("{at}[{i}]"), h, k, out);
            }
        }
        (h, k) if h != k => out.push(format!(
            "{at}: chart {}, kustomize {}",
            compact(h),
            compact(k)
        )),
        _ => {}
    }
}

fn compact(value: &Value) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| format!("{value:?}"))
}

/// The chart's rendering and kustomize's are the same objects, field by field, except
/// for the Namespace (the chart's is the release namespace, which `helm install
/// --create-namespace` creates: Helm keeps its release record there before it applies
/// anything) and the labels that name the installing tool.
fn assert_same_objects(helm_yaml: &str, kustomize_yaml: &str, what: &str) {
    let mut helm = objects(helm_yaml, "helm template");
    let mut kustomize = objects(kustomize_yaml, "kubectl kustomize");
    let namespace = key("Namespace", "", NAMESPACE);
    assert!(
        kustomize.remove(&namespace).is_some(),
        "{what}: kustomize renders no {}",
        show(&namespace)
    );
    assert!(
        kustomize.keys().any(|k| k.0 == "Deployment"),
        "{what}: kustomize renders no Deployment:\n{kustomize_yaml}"
    );
    let mut problems = Vec::new();
    for (key, object) in helm.iter_mut() {
        take_tool_labels(key, object, &mut problems);
    }
    let keys: BTreeSet<&Key> = helm.keys().chain(kustomize.keys()).collect();
    for key in keys {
        match (helm.get(key), kustomize.get(key)) {
            (Some(h), Some(k)) => {
                let mut found = Vec::new();
                differences("", h, k, &mut found);
                problems.extend(found.into_iter().map(|d| format!("{}: {d}", show(key))));
            }
            (Some(_), None) => problems.push(format!("{}: only the chart renders it", show(key))),
            (None, Some(_)) => problems.push(format!("{}: only kustomize renders it", show(key))),
            (None, None) => unreachable!("a key of one of them"),
        }
    }
    assert!(
        problems.is_empty(),
        "{what}: {} difference(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// The tools.

/// A binary of the cache, as `cargo xtask test` names it in `env`.
fn tool(env: &str, name: &str) -> PathBuf {
    let path = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        panic!(
            "{env} is not set: run the tests with `cargo xtask test`, which builds {name} \
             into the binaries cache (or point {env} at the one `cargo xtask cluster build` \
             printed the directory of)"
        )
    });
    assert!(
        path.is_file(),
        "{env}={} does not exist: build it with `cargo xtask cluster build`",
        path.display()
    );
    path
}

fn helm() -> Command {
    let mut cmd = Command::new(tool("CAPSTAN_HELM", "helm"));
    // Helm's own state (repository caches, registry logins) stays out of $HOME.
    let home = std::env::temp_dir().join("capstan-e2e-helm");
    for (var, dir) in [
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ] {
        cmd.env(var, home.join(dir));
    }
    cmd
}

fn kubectl() -> Command {
    Command::new(tool("CAPSTAN_KUBECTL", "kubectl"))
}

/// Runs `cmd` (with `stdin`), failing the test with its stderr if it fails.
fn output(cmd: &mut Command, stdin: Option<&str>) -> String {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    let mut input = child.stdin.take().expect("stdin");
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).expect("write stdin");
    }
    drop(input);
    let out = child.wait_with_output().expect("wait");
    assert!(
        out.status.success(),
        "{shown} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

fn helm_template(release: &str, namespace: &str, values: &[&str]) -> String {
    output(
        helm()
            .args(["template", release])
            .arg(root().join(CHART))
            .args(["--namespace", namespace, "--include-crds"])
            .args(values),
        None,
    )
}

fn kubectl_kustomize(dir: &str) -> String {
    output(kubectl().arg("kustomize").arg(root().join(dir)), None)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// A values file, for values whose keys hold dots (`kubernetes.io/hostname`).
fn values_file(values: &serde_json::Value) -> tempfile::NamedTempFile {
    let mut file = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
    let yaml = serde_yaml_ng::to_string(values).unwrap();
    file.write_all(yaml.as_bytes()).unwrap();
    file
}

// ---------------------------------------------------------------------------------------
// The installed release.

/// A release installed by `helm install`; uninstalled when dropped (a failed test
/// included), and waited for by [`Release::uninstall`].
struct Release {
    name: String,
    namespace: String,
    installed: bool,
}

impl Release {
    fn install(name: &str, namespace: &str, values: &Path) -> Release {
        // Before the install: a failed one leaves objects behind too.
        let release = Release {
            name: name.into(),
            namespace: namespace.into(),
            installed: true,
        };
        // Without --wait: the test polls the Pod itself, to say what is wrong if it
        // never becomes Ready. The CRDs come from the chart's crds/ (Helm skips those
        // that exist already).
        output(
            helm()
                .args(["install", name])
                .arg(root().join(CHART))
                .args(["--namespace", namespace, "-f"])
                .arg(values),
            None,
        );
        release
    }

    fn uninstall(mut self) {
        self.installed = false;
        output(
            helm()
                .args(["uninstall", &self.name, "--namespace", &self.namespace])
                .args(["--wait", "--timeout", "2m"]),
            None,
        );
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        if self.installed {
            let _ = helm()
                .args(["uninstall", &self.name, "--namespace", &self.namespace])
                .arg("--ignore-not-found")
                .status();
        }
    }
}

/// What is left of a release: its namespaced objects of every kind the chart makes,
/// and its cluster-scoped ones.
async fn release_objects(
    client: &kube::Client,
    ns: &str,
    selector: &str,
) -> anyhow::Result<Vec<String>> {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
    let lp = ListParams::default().labels(selector);
    let mut left = Vec::new();
    macro_rules! collect {
        ($api:expr, $kind:literal) => {
            for o in $api.list(&lp).await?.items {
                left.push(format!("{} {}", $kind, o.metadata.name.unwrap_or_default()));
            }
        };
    }
    collect!(
        Api::<Deployment>::namespaced(client.clone(), ns),
        "Deployment"
    );
    collect!(Api::<Pod>::namespaced(client.clone(), ns), "Pod");
    collect!(Api::<Service>::namespaced(client.clone(), ns), "Service");
    collect!(
        Api::<ServiceAccount>::namespaced(client.clone(), ns),
        "ServiceAccount"
    );
    collect!(
        Api::<ConfigMap>::namespaced(client.clone(), ns),
        "ConfigMap"
    );
    collect!(Api::<Role>::namespaced(client.clone(), ns), "Role");
    collect!(
        Api::<RoleBinding>::namespaced(client.clone(), ns),
        "RoleBinding"
    );
    collect!(Api::<ClusterRole>::all(client.clone()), "ClusterRole");
    collect!(
        Api::<ClusterRoleBinding>::all(client.clone()),
        "ClusterRoleBinding"
    );
    Ok(left)
}

// ---------------------------------------------------------------------------------------
// The real node.

/// The Ready node that is not a kwok node; fails the test if there is none.
async fn real_node(client: &kube::Client) -> String {
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("list Nodes");
    let real: Vec<&Node> = nodes
        .items
        .iter()
        .filter(|n| {
            let annotations = n.metadata.annotations.as_ref();
            !annotations.is_some_and(|a| a.contains_key("kwok.x-k8s.io/node"))
        })
        .collect();
    let names = |nodes: &[&Node]| {
        nodes
            .iter()
            .map(|n| n.metadata.name.clone().unwrap_or_default())
            .collect::<Vec<_>>()
    };
    let ready: Vec<&Node> = real
        .iter()
        .copied()
        .filter(|n| {
            let conditions = n.status.as_ref().and_then(|s| s.conditions.as_ref());
            conditions.is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .collect();
    match &ready[..] {
        [node] => node.metadata.name.clone().unwrap_or_default(),
        [] => panic!(
            "no real node Ready in the cluster (nodes that are not kwok's: {:?}; all: {:?}). \
             This test runs Capstan's image for real: it needs the node `cargo xtask cluster \
             up` starts where the machine allows it (root, namespaces, cgroups)",
            names(&real),
            nodes
                .items
                .iter()
                .map(|n| n.metadata.name.clone().unwrap_or_default())
                .collect::<Vec<_>>()
        ),
        more => panic!("several real nodes, expected one: {:?}", names(more)),
    }
}

async fn node_hostname(client: &kube::Client, node: &str) -> String {
    let node = Api::<Node>::all(client.clone()).get(node).await.unwrap();
    let labels = node.metadata.labels.unwrap_or_default();
    labels
        .get("kubernetes.io/hostname")
        .cloned()
        .unwrap_or_else(|| panic!("node without the label kubernetes.io/hostname: {labels:?}"))
}

/// Waits until the kubelet reports `image` among the node's images (it reports them
/// with its status, every few seconds); fails the test, saying how to get it there,
/// if it does not.
async fn wait_for_image(client: &kube::Client, node: &str, image: &str) {
    let nodes = Api::<Node>::all(client.clone());
    let suffix = format!("/{image}");
    let found = wait_for(
        &format!("image {image} on node {node}"),
        Duration::from_secs(30),
        || {
            let (nodes, suffix) = (nodes.clone(), suffix.clone());
            async move {
                let node = nodes.get(node).await?;
                let images = node.status.and_then(|s| s.images).unwrap_or_default();
                let names: Vec<String> = images
                    .into_iter()
                    .flat_map(|i| i.names.unwrap_or_default())
                    .collect();
                let there = names.iter().any(|n| n == image || n.ends_with(&suffix));
                match there {
                    true => Ok(Some(())),
                    false => anyhow::bail!("the node has {names:?}"),
                }
            }
        },
    )
    .await;
    if let Err(e) = found {
        panic!(
            "{e}\nthe image {image} is not on the node: build and import it with `cargo xtask \
             image --import`"
        );
    }
}

fn is_ready(pod: &Pod) -> bool {
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The release's Pods, their containers' states and logs, and the namespace's events:
/// what a failure message needs.
async fn pod_report(client: &kube::Client, ns: &str, selector: &str) -> String {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    let mut report = String::new();
    let list = pods
        .list(&ListParams::default().labels(selector))
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    for pod in &list {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let status = pod.status.clone().unwrap_or_default();
        report += &format!(
            "Pod {name} on {:?}: {:?}\n",
            pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            status.phase
        );
        let containers = status.init_container_statuses.iter().flatten();
        for c in containers.chain(status.container_statuses.iter().flatten()) {
            report += &format!(
                "  {}: ready={} restarts={} state={:?} last={:?}\n",
                c.name, c.ready, c.restart_count, c.state, c.last_state
            );
        }
        for container in ["seed-plugins", "capstan"] {
            let params = LogParams {
                container: Some(container.into()),
                tail_lines: Some(30),
                ..LogParams::default()
            };
            if let Ok(log) = pods.logs(&name, &params).await {
                report += &format!("  log of {container}:\n{log}\n");
            }
        }
    }
    let events = output(kubectl().args(["get", "events", "-n", ns]), None);
    report + "events:\n" + &events
}

/// A value of one series in Prometheus' text format.
fn series(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

/// `kubectl port-forward` to the Pod's metrics port, stopped (by PID) when dropped.
struct PortForward {
    child: Child,
    port: u16,
}

impl PortForward {
    fn start(ns: &str, pod: &str) -> PortForward {
        let mut child = kubectl()
            .args(["port-forward", "-n", ns, &format!("pod/{pod}"), ":8080"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("run kubectl port-forward");
        // "Forwarding from 127.0.0.1:PORT -> 8080", then a line per connection: the
        // pipe is drained until kubectl exits, or a full pipe would stall it.
        let stdout = child.stdout.take().expect("stdout");
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let port = line
                    .strip_prefix("Forwarding from 127.0.0.1:")
                    .and_then(|rest| rest.split_whitespace().next()?.parse::<u16>().ok());
                if let Some(port) = port {
                    let _ = port_tx.send(port);
                }
            }
        });
        match port_rx.recv_timeout(Duration::from_secs(30)) {
            Ok(port) => PortForward { child, port },
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "kubectl port-forward to {ns}/{pod} exited, or printed no local port \
                     within 30 s (its error output is above)"
                );
            }
        }
    }
}

impl Drop for PortForward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
