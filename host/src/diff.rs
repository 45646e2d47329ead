//! `capstan plan`: what a plugin version would change, parent by parent, as field-level
//! differences between two versions of each object — the live object and what a dry-run
//! server-side apply of the new answer returns (`--live`), or the old version's answer
//! and the new one's on the same observed state (`--against`).
//!
//! This module holds what both modes share: the differences of two JSON objects by field
//! path, a parent's outcome and how it is printed, and the summary line.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use serde_json::{Map, Value};

/// One field that differs: its path (`spec.template.spec.containers[name=pg].image`),
/// its value before (none: absent) and after (none: removed).
#[derive(Debug, Clone, PartialEq)]
pub struct FieldChange {
    /// Where, in the object.
    pub path: String,
    /// The value before.
    pub old: Option<Value>,
    /// The value after.
    pub new: Option<Value>,
}

/// The fields that differ between `old` and `new`, in path order. Objects are compared
/// key by key; lists whose items are all objects with a `name` (containers, volumes,
/// env, ports of a Service) item by name, as server-side apply merges them; other lists
/// item by position.
pub fn diff(old: &Value, new: &Value) -> Vec<FieldChange> {
    let mut out = Vec::new();
    walk("", Some(old), Some(new), &mut out);
    out
}

fn walk(path: &str, old: Option<&Value>, new: Option<&Value>, out: &mut Vec<FieldChange>) {
    match (old, new) {
        (Some(Value::Object(a)), Some(Value::Object(b))) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                walk(&field(path, key), a.get(key), b.get(key), out);
            }
        }
        (Some(Value::Array(a)), Some(Value::Array(b))) => match (named(a), named(b)) {
            (Some(by_name_a), Some(by_name_b)) => {
                let names: BTreeSet<&str> = by_name_a
                    .iter()
                    .chain(&by_name_b)
                    .map(|(name, _)| *name)
                    .collect();
                // Kept in the order of the new list, then the removed ones.
                let mut order: Vec<&str> = by_name_b.iter().map(|(n, _)| *n).collect();
                order.extend(names.iter().filter(|n| find(&by_name_b, n).is_none()));
                for name in order {
                    let item = format!("{path}[name={name}]");
                    walk(&item, find(&by_name_a, name), find(&by_name_b, name), out);
                }
            }
            _ => {
                for i in 0..a.len().max(b.len()) {
                    walk(&format!("{path}[{i}]"), a.get(i), b.get(i), out);
                }
            }
        },
        (a, b) if a == b => {}
        (a, b) => out.push(FieldChange {
            path: path.to_string(),
            old: a.cloned(),
            new: b.cloned(),
        }),
    }
}

fn find<'a>(items: &[(&str, &'a Value)], name: &str) -> Option<&'a Value> {
    items.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
}

/// The items of a list by their `name`, when every item is an object with a unique one.
fn named(items: &[Value]) -> Option<Vec<(&str, &Value)>> {
    let mut out = Vec::with_capacity(items.len());
    let mut seen = BTreeSet::new();
    for item in items {
        let name = item.get("name")?.as_str()?;
        if !seen.insert(name) {
            return None;
        }
        out.push((name, item));
    }
    (!out.is_empty()).then_some(out)
}

/// `path.key`, or `path["key"]` for a key that is not a plain identifier (a label such as
/// `app.kubernetes.io/name`).
fn field(path: &str, key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    match (path.is_empty(), plain) {
        (true, true) => key.to_string(),
        (false, true) => format!("{path}.{key}"),
        (_, false) => format!("{path}[{key:?}]"),
    }
}

/// What the API server sets on every object and no plugin writes: left out of a
/// comparison between a live object and what an apply would make of it.
pub fn without_server_fields(mut object: Value) -> Value {
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        for key in [
            "managedFields",
            "resourceVersion",
            "generation",
            "creationTimestamp",
            "uid",
            "selfLink",
        ] {
            meta.remove(key);
        }
    }
    object
}

/// What one child would become.
#[derive(Debug, Clone, PartialEq)]
pub enum ChildChange {
    /// It does not exist and would be created with this manifest.
    Created,
    /// It exists and these of its fields would change.
    Changed(Vec<FieldChange>),
    /// It exists and would be deleted (pruned: the new answer no longer has it).
    Deleted,
    /// An object of its name that this parent does not control: nothing would be
    /// written (the reconcile reports a ChildConflict).
    Conflict(String),
}

/// One child of a parent's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildOutcome {
    /// Its kind, as `Kind.group/version`-free `Kind`.
    pub kind: String,
    /// `namespace/name`, or `name` for a cluster-scoped one.
    pub name: String,
    /// What would happen to it.
    pub change: ChildChange,
}

/// What a plugin version would do to one parent.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// It would write children (or a status) that differ.
    Changes {
        /// The children that would change, in a stable order; unchanged ones are left out.
        children: Vec<ChildOutcome>,
        /// The fields of the status that would change.
        status: Vec<FieldChange>,
    },
    /// The reconcile would fail (the plugin errs, traps or runs out of time, its answer
    /// is refused, or an apply would be refused): why, in one line.
    Failing(String),
}

impl Outcome {
    /// Whether nothing would change.
    pub fn is_unchanged(&self) -> bool {
        matches!(self, Outcome::Changes { children, status } if children.is_empty() && status.is_empty())
    }
}

/// The outcome of one parent, named `namespace/name`.
#[derive(Debug, Clone, PartialEq)]
pub struct ParentOutcome {
    /// `namespace/name` (or `name`).
    pub parent: String,
    /// What would happen.
    pub outcome: Outcome,
}

/// How many parents would not change, change or fail.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Unchanged.
    pub unchanged: usize,
    /// Changed.
    pub changed: usize,
    /// Failing.
    pub failing: usize,
}

impl Summary {
    /// Counts `outcomes`.
    pub fn of(outcomes: &[ParentOutcome]) -> Self {
        let mut s = Summary::default();
        for o in outcomes {
            match &o.outcome {
                Outcome::Failing(_) => s.failing += 1,
                o if o.is_unchanged() => s.unchanged += 1,
                _ => s.changed += 1,
            }
        }
        s
    }

    /// Whether anything would change (or fail): `kubectl diff`'s exit status 1.
    pub fn any(&self) -> bool {
        self.changed + self.failing > 0
    }
}

impl std::fmt::Display for Summary {
    /// `N parents: X unchanged, Y changed, Z failing`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} parents: {} unchanged, {} changed, {} failing",
            self.unchanged + self.changed + self.failing,
            self.unchanged,
            self.changed,
            self.failing
        )
    }
}

/// The report of `capstan plan`: every parent that would change or fail, with its
/// children and status fields (unchanged parents are only counted), then the summary.
pub fn report(kind: &str, outcomes: &[ParentOutcome]) -> String {
    let mut out = String::new();
    for parent in outcomes {
        match &parent.outcome {
            Outcome::Failing(why) => {
                let _ = writeln!(out, "{kind} {}: failing: {why}", parent.parent);
            }
            o if o.is_unchanged() => {}
            Outcome::Changes { children, status } => {
                let _ = writeln!(out, "{kind} {}: changed", parent.parent);
                for child in children {
                    let (mark, what) = match &child.change {
                        ChildChange::Created => ("+", "created"),
                        ChildChange::Changed(_) => ("~", "changed"),
                        ChildChange::Deleted => ("-", "deleted"),
                        ChildChange::Conflict(_) => ("!", "conflict"),
                    };
                    let _ = writeln!(out, "  {mark} {} {} ({what})", child.kind, child.name);
                    match &child.change {
                        ChildChange::Changed(fields) => {
                            fields_into(&mut out, fields, child.kind == "Secret")
                        }
                        ChildChange::Conflict(why) => {
                            let _ = writeln!(out, "      {why}");
                        }
                        _ => {}
                    }
                }
                if !status.is_empty() {
                    let _ = writeln!(out, "  ~ status");
                    fields_into(&mut out, status, false);
                }
            }
        }
    }
    let _ = writeln!(out, "{}", Summary::of(outcomes));
    out
}

/// Writes one line per field; a Secret's values (`data`, `stringData`) are never shown,
/// only that they change, as `kubectl diff` masks them.
fn fields_into(out: &mut String, fields: &[FieldChange], secret: bool) {
    let hidden = |path: &str| {
        secret
            && ["data", "stringData"].iter().any(|p| {
                path == *p
                    || path.starts_with(&format!("{p}."))
                    || path.starts_with(&format!("{p}["))
            })
    };
    let show = |v: &Option<Value>, masked: bool| match v {
        None => "(absent)".to_string(),
        Some(_) if masked => "***".to_string(),
        Some(v) => {
            let text = v.to_string();
            if text.len() > 120 {
                format!("{}…", text.chars().take(119).collect::<String>())
            } else {
                text
            }
        }
    };
    for f in fields {
        let masked = hidden(&f.path);
        let (old, new) = (show(&f.old, masked), show(&f.new, masked));
        let _ = writeln!(out, "      {}: {old} -> {new}", f.path);
    }
}

/// A status to compare: the plugin's answer as the host would write it. Condition
/// timestamps are left out — `now` differs from one run to the next, and a condition
/// that keeps its status keeps its time anyway.
pub fn comparable_status(status: &Value) -> Value {
    let mut status = status.clone();
    if let Some(conditions) = status.get_mut("conditions").and_then(Value::as_array_mut) {
        for c in conditions {
            if let Some(c) = c.as_object_mut() {
                c.remove("lastTransitionTime");
            }
        }
    }
    status
}

/// `namespace/name` of an object, or `name` for a cluster-scoped one: how `capstan
/// plan` and shadow mode name parents and children.
pub fn qualified_name(object: &Value) -> String {
    let field = |p: &str| object.pointer(p).and_then(Value::as_str).unwrap_or("");
    match field("/metadata/namespace") {
        "" => field("/metadata/name").to_string(),
        ns => format!("{ns}/{}", field("/metadata/name")),
    }
}

/// The key of a child manifest across two plugin versions (whose declared kinds may
/// differ): kind, API group (not version: the same object in another version is the
/// same object) and qualified name.
fn manifest_key(manifest: &Value) -> (String, String, String) {
    let field = |p: &str| manifest.pointer(p).and_then(Value::as_str).unwrap_or("");
    let group = field("/apiVersion")
        .rsplit_once('/')
        .map_or("", |(group, _)| group);
    (
        field("/kind").to_string(),
        group.to_string(),
        qualified_name(manifest),
    )
}

/// What the new answer would change compared with the old one, both plans made from the
/// same observed state (`capstan plan --against`). An old version that fails wrote
/// nothing: every child of the new one counts as created.
pub fn compare_plans(
    old: Result<&crate::plan::Plan, &str>,
    new: Result<&crate::plan::Plan, &str>,
) -> Outcome {
    let new = match new {
        Ok(plan) => plan,
        Err(why) => return Outcome::Failing(why.to_string()),
    };
    let old_children: Vec<&Value> = match old {
        Ok(plan) => plan.children.iter().map(|c| &c.manifest).collect(),
        Err(_) => Vec::new(),
    };
    let find = |key: &(String, String, String)| {
        old_children
            .iter()
            .find(|m| &manifest_key(m) == key)
            .copied()
    };
    let mut children = Vec::new();
    for child in &new.children {
        let key = manifest_key(&child.manifest);
        let change = match find(&key) {
            None => ChildChange::Created,
            Some(before) => match diff(before, &child.manifest) {
                fields if fields.is_empty() => continue,
                fields => ChildChange::Changed(fields),
            },
        };
        children.push(ChildOutcome {
            kind: key.0,
            name: key.2,
            change,
        });
    }
    for before in old_children {
        let key = manifest_key(before);
        if !new
            .children
            .iter()
            .any(|c| manifest_key(&c.manifest) == key)
        {
            children.push(ChildOutcome {
                kind: key.0,
                name: key.2,
                change: ChildChange::Deleted,
            });
        }
    }
    let old_status = match old {
        Ok(plan) => comparable_status(&plan.status),
        Err(_) => empty(),
    };
    let status = diff(&old_status, &comparable_status(&new.status))
        .into_iter()
        .map(|mut f| {
            f.path = format!("status.{}", f.path);
            f
        })
        .collect();
    Outcome::Changes { children, status }
}

/// The empty object, for an absent status.
pub fn empty() -> Value {
    Value::Object(Map::new())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn fields_are_compared_by_path_and_named_lists_by_name() {
        let old = json!({"spec": {"replicas": 1, "template": {"spec": {"containers": [
            {"name": "pg", "image": "postgres:16.14", "env": [{"name": "A", "value": "1"}]},
            {"name": "agent", "image": "a:1"}]}}},
            "metadata": {"labels": {"app.kubernetes.io/name": "x"}}});
        let new = json!({"spec": {"replicas": 1, "template": {"spec": {"containers": [
            {"name": "agent", "image": "a:1"},
            {"name": "pg", "image": "postgres:16.15", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}]}}},
            "metadata": {"labels": {"app.kubernetes.io/name": "y"}}});
        let changes = diff(&old, &new);
        let paths: Vec<&str> = changes.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "metadata.labels[\"app.kubernetes.io/name\"]",
                "spec.template.spec.containers[name=pg].env[name=B]",
                "spec.template.spec.containers[name=pg].image",
            ],
            "the containers' order is not a change"
        );
        assert_eq!(changes[1].old, None);
        assert_eq!(changes[2].old, Some(json!("postgres:16.14")));
        assert_eq!(changes[2].new, Some(json!("postgres:16.15")));
        assert!(diff(&old, &old).is_empty());
    }

    #[test]
    fn other_lists_are_compared_by_position() {
        let changes = diff(
            &json!({"args": ["a", "b"]}),
            &json!({"args": ["a", "c", "d"]}),
        );
        let paths: Vec<&str> = changes.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(paths, ["args[1]", "args[2]"]);
        assert_eq!(changes[1].old, None);
    }

    #[test]
    fn the_summary_line_and_the_report() {
        let outcomes = vec![
            ParentOutcome {
                parent: "ns/a".into(),
                outcome: Outcome::Changes {
                    children: vec![],
                    status: vec![],
                },
            },
            ParentOutcome {
                parent: "ns/b".into(),
                outcome: Outcome::Changes {
                    children: vec![
                        ChildOutcome {
                            kind: "ConfigMap".into(),
                            name: "ns/b".into(),
                            change: ChildChange::Changed(diff(
                                &json!({"data": {"k": "1"}}),
                                &json!({"data": {"k": "2"}}),
                            )),
                        },
                        ChildOutcome {
                            kind: "Secret".into(),
                            name: "ns/b-old".into(),
                            change: ChildChange::Deleted,
                        },
                    ],
                    status: vec![],
                },
            },
            ParentOutcome {
                parent: "ns/c".into(),
                outcome: Outcome::Failing("reconcile failed: no".into()),
            },
        ];
        let summary = Summary::of(&outcomes);
        assert_eq!(
            summary.to_string(),
            "3 parents: 1 unchanged, 1 changed, 1 failing"
        );
        assert!(summary.any());
        let text = report("Widget", &outcomes);
        assert_eq!(
            text,
            "Widget ns/b: changed\n  ~ ConfigMap ns/b (changed)\n      data.k: \"1\" -> \"2\"\n  - Secret ns/b-old (deleted)\nWidget ns/c: failing: reconcile failed: no\n3 parents: 1 unchanged, 1 changed, 1 failing\n"
        );
        assert!(!Summary::of(&outcomes[..1]).any());
        // A Secret's values are never printed, only that they change.
        let secret = ParentOutcome {
            parent: "ns/d".into(),
            outcome: Outcome::Changes {
                children: vec![ChildOutcome {
                    kind: "Secret".into(),
                    name: "ns/d".into(),
                    change: ChildChange::Changed(diff(
                        &json!({"data": {"password": "czNjcjN0"}, "type": "Opaque"}),
                        &json!({"data": {"password": "b3RoZXI=", "user": "YQ=="}, "type": "x"}),
                    )),
                }],
                status: vec![],
            },
        };
        let text = report("Widget", &[secret]);
        assert!(
            text.contains("data.password: *** -> ***\n")
                && text.contains("data.user: (absent) -> ***\n")
                && text.contains("type: \"Opaque\" -> \"x\"\n"),
            "{text}"
        );
        assert!(
            !text.contains("czNjcjN0") && !text.contains("b3RoZXI="),
            "{text}"
        );
    }
}
