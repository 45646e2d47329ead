//! `capstan plan --against`: two versions of the PostgreSQL plugin compared on the same
//! observed state, without a cluster — the shipped one, and the same code built with
//! its images from a mirror (`postgresql-mirror`, built by `cargo xtask plugins`).
//! `--live` is tested against the local control plane (tests/e2e/tests/plan.rs).

mod common;

use std::path::Path;

use common::{capstan, plugin, root, test_plugin};
use serde_json::Value;

/// The children `capstan render` gives the sample parent with the shipped plugin,
/// written as the observed state of a second reconcile (the Secret's password included,
/// which a plugin draws at random only while it has not observed one).
fn observed_after_render(dir: &Path) -> String {
    let rendered = render_sample(&[]);
    let children = rendered["children"].as_array().unwrap();
    assert!(children.len() > 3, "{rendered}");
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": children});
    let path = dir.join("observed.yaml");
    std::fs::write(&path, serde_yaml_ng::to_string(&list).unwrap()).unwrap();
    path.display().to_string()
}

/// The sample parent with the status a second reconcile (of `observed`) gives it, as a
/// running cluster's parent has one. The plugin records in it since when the primary is
/// not ready (`primaryNotReadySince`, from its clock): without it, each version of a
/// plan would read the clock itself, and two calls a second apart would differ.
fn parent_after_render(dir: &Path, observed: &str) -> String {
    let rendered = render_sample(&["--observed", observed]);
    let status = &rendered["status"];
    assert!(
        status["primaryNotReadySince"].is_string(),
        "the status records since when the primary is not ready: {status}"
    );
    let mut parent: Value =
        serde_yaml_ng::from_slice(&std::fs::read(sample_path()).unwrap()).unwrap();
    parent["status"] = status.clone();
    let path = dir.join("parent.yaml");
    std::fs::write(&path, serde_yaml_ng::to_string(&parent).unwrap()).unwrap();
    path.display().to_string()
}

/// The sample PostgreSQLCluster.
fn sample_path() -> std::path::PathBuf {
    root().join("crds/samples/postgresqlcluster.yaml")
}

/// `capstan render` of the sample parent with the shipped plugin and `extra` arguments.
fn render_sample(extra: &[&str]) -> Value {
    let (plugin, sample) = (plugin("postgresql"), sample_path());
    let mut args = vec![
        "render",
        "--plugin",
        plugin.to_str().unwrap(),
        "--parent",
        sample.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = capstan(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_yaml_ng::from_slice(&out.stdout).unwrap()
}

/// `capstan plan --plugin NEW --against OLD --parent PARENT [--observed OBSERVED]`.
fn plan_against(
    new: &Path,
    old: &Path,
    parent: &Path,
    observed: Option<&str>,
) -> (Option<i32>, String, String) {
    let mut args = vec![
        "--plugin",
        new.to_str().unwrap(),
        "--against",
        old.to_str().unwrap(),
        "--parent",
        parent.to_str().unwrap(),
    ];
    if let Some(observed) = observed {
        args.extend(["--observed", observed]);
    }
    plan(&args)
}

fn plan(args: &[&str]) -> (Option<i32>, String, String) {
    let mut all = vec!["plan"];
    all.extend_from_slice(args);
    let out = capstan(&all);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_version_that_changes_the_image_lists_exactly_the_image_fields() {
    let dir = tempfile::tempdir().unwrap();
    let observed = observed_after_render(dir.path());
    let parent = parent_after_render(dir.path(), &observed);
    let (code, out, err) = plan_against(
        &test_plugin("postgresql-mirror"),
        &plugin("postgresql"),
        Path::new(&parent),
        Some(&observed),
    );
    assert_eq!(code, Some(1), "something changes: {out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "PostgreSQLCluster default/demo: changed", "{out}");
    assert_eq!(
        *lines.last().unwrap(),
        "1 parents: 0 unchanged, 1 changed, 0 failing"
    );
    // Every field that changes is an image, from the official one to the mirror's.
    let fields: Vec<&str> = lines
        .iter()
        .filter(|l| l.starts_with("      "))
        .map(|l| l.trim())
        .collect();
    assert!(!fields.is_empty(), "{out}");
    for field in &fields {
        assert!(
            field.contains(
                ".image: \"postgres:16.15\" -> \"mirror.example.com/library/postgres:16.15\""
            ),
            "{field} is not an image change\n{out}"
        );
    }
    assert!(
        out.contains("  ~ StatefulSet default/demo (changed)"),
        "{out}"
    );
    assert!(
        !out.contains("(created)") && !out.contains("(deleted)"),
        "{out}"
    );
}

#[test]
fn the_same_version_changes_nothing_and_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    let observed = observed_after_render(dir.path());
    let parent = parent_after_render(dir.path(), &observed);
    let shipped = plugin("postgresql");
    let (code, out, err) = plan_against(&shipped, &shipped, Path::new(&parent), Some(&observed));
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(out, "1 parents: 1 unchanged, 0 changed, 0 failing\n");
}

/// A parent that has nothing yet: each version draws the Secret's password and stamps
/// since when the primary is not ready. Both versions read the same pinned clock and
/// random bytes, so the plan shows no change that is only the draw or the clock.
#[test]
fn a_new_parent_planned_against_the_same_version_changes_nothing() {
    let shipped = plugin("postgresql");
    let (code, out, err) = plan_against(&shipped, &shipped, &sample_path(), None);
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(out, "1 parents: 1 unchanged, 0 changed, 0 failing\n");
}

#[test]
fn a_parent_the_new_version_refuses_is_failing() {
    let dir = tempfile::tempdir().unwrap();
    let parent = dir.path().join("bad.yaml");
    // More instances than the CRD allows (what its schema would refuse at the API
    // server): the plugin's reconcile fails.
    std::fs::write(
        &parent,
        "apiVersion: db.example.com/v1alpha1\nkind: PostgreSQLCluster\nmetadata: {name: bad}\nspec: {replicas: 99, version: \"16.15\", storage: 1Gi}\n",
    )
    .unwrap();
    let (code, out, err) = plan_against(
        &test_plugin("postgresql-mirror"),
        &plugin("postgresql"),
        &parent,
        None,
    );
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.starts_with("PostgreSQLCluster default/bad: failing: "),
        "{out}"
    );
    assert!(
        out.ends_with("1 parents: 0 unchanged, 0 changed, 1 failing\n"),
        "{out}"
    );
}

#[test]
fn bad_input_is_one_line_and_exit_status_two() {
    let missing = "/nonexistent/new.wasm";
    let (code, out, err) = plan_against(
        Path::new(missing),
        &plugin("postgresql"),
        &root().join("crds/samples/postgresqlcluster.yaml"),
        None,
    );
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(out.is_empty(), "{out}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("capstan: ") && err.contains(missing),
        "{err}"
    );
    // Neither --against nor --live: clap's usage error (exit status 2).
    let (code, _, err) = plan(&["--plugin", missing]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--against") && err.contains("--live"), "{err}");
}
