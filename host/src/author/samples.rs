//! `capstan test`: every sample parent of a project rendered and compared with its
//! golden file.
//!
//! In `samples/`, each `NAME.yaml` is a parent; beside it, `NAME.golden.yaml` is what it
//! renders to (the children, status, conditions and events `capstan render` prints, or
//! `error: …` when the plugin refuses it), and optionally `NAME.observed.yaml` (children
//! that exist), `NAME.related.yaml` (related objects that exist) and `NAME.old.yaml`
//! (the parent before an update). Rendering uses a fixed clock, [`CLOCK`], so that the
//! conditions' times do not change from run to run.
//!
//! A plugin that validates (admission) gets its verdict in the golden file too, under
//! `admission`: `validate(old, new)` of the sample — a create without `NAME.old.yaml`,
//! an update from it — either `allowed` (with its warnings) or `refused` (the message).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::{IoContext, Result, invalid};
use serde_json::{Value, json};

use crate::plugin::Plugin;
use crate::render;

/// The time every sample is rendered at.
pub const CLOCK: &str = "1970-01-01T00:00:00Z";

/// The file name endings that are not parents.
const COMPANIONS: [&str; 4] = [
    ".golden.yaml",
    ".observed.yaml",
    ".related.yaml",
    ".old.yaml",
];

/// One sample parent and its companions.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// `NAME`.
    pub name: String,
    /// `NAME.yaml`.
    pub parent: PathBuf,
    /// `NAME.golden.yaml` (it may not exist yet).
    pub golden: PathBuf,
    /// `NAME.observed.yaml`, if it exists.
    pub observed: Option<PathBuf>,
    /// `NAME.related.yaml`, if it exists.
    pub related: Option<PathBuf>,
    /// `NAME.old.yaml`, if it exists.
    pub old: Option<PathBuf>,
}

/// The samples of a directory, by name.
pub fn find(dir: &Path) -> Result<Vec<Sample>> {
    let entries =
        std::fs::read_dir(dir).doing(|| format!("no samples: cannot read {}", dir.display()))?;
    let mut samples = Vec::new();
    for entry in entries {
        let path = entry.doing(|| format!("read {}", dir.display()))?.path();
        let Some(file) = path.file_name().and_then(|f| f.to_str()) else {
            continue;
        };
        if !file.ends_with(".yaml") || COMPANIONS.iter().any(|c| file.ends_with(c)) {
            continue;
        }
        let name = file.trim_end_matches(".yaml").to_string();
        let companion = |ending: &str| dir.join(format!("{name}{ending}"));
        let existing = |p: PathBuf| p.is_file().then_some(p);
        samples.push(Sample {
            golden: companion(".golden.yaml"),
            observed: existing(companion(".observed.yaml")),
            related: existing(companion(".related.yaml")),
            old: existing(companion(".old.yaml")),
            parent: path,
            name,
        });
    }
    samples.sort_by(|a, b| a.name.cmp(&b.name));
    if samples.is_empty() {
        invalid!("no samples in {}: add a parent as NAME.yaml", dir.display());
    }
    Ok(samples)
}

/// What a sample renders to, as the text of its golden file.
pub fn render_sample(plugin: &Plugin, sample: &Sample) -> Result<String> {
    let rendered = (|| -> Result<Value> {
        let mut observed =
            render::read_observed(plugin, &sample.parent, sample.observed.as_deref())?;
        let related = match &sample.related {
            Some(path) => render::read_related(plugin.info(), path)?,
            None => Vec::new(),
        };
        render::customize(plugin, &mut observed, &related)?;
        let rendered = render::render(plugin, &observed, CLOCK)?;
        Ok(serde_json::to_value(&rendered)?)
    })();
    let mut value = match rendered {
        Ok(value) => value,
        // A refusal is an outcome to pin down like any other.
        Err(e) => json!({ "error": crate::one_line(&e) }),
    };
    if plugin.info().validation.is_some() {
        value["admission"] = admission(plugin, sample)?;
    }
    Ok(serde_yaml_ng::to_string(&value)?)
}

/// `validate(old, new)` of a sample: `{allowed: true, warnings: [...]}` or
/// `{allowed: false, refused: "..."}`.
fn admission(plugin: &Plugin, sample: &Sample) -> Result<Value> {
    let new = render::read_one(&sample.parent)?;
    let old = sample.old.as_deref().map(render::read_one).transpose()?;
    let verdict = match plugin.validate_blocking(old.as_ref(), &new) {
        Ok(Ok(warnings)) => json!({ "allowed": true, "warnings": warnings }),
        Ok(Err(refusal)) => json!({ "allowed": false, "refused": refusal }),
        Err(e) => json!({ "error": crate::one_line(&e) }),
    };
    Ok(verdict)
}

/// How a rendered sample compares with its golden file.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// The same objects.
    Same,
    /// Different: the fields that differ, one per line (`path: golden -> rendered`).
    Differs(String),
    /// There is no golden file yet.
    NoGolden,
}

/// Compares a rendering with the golden file's text, as objects (so a golden file
/// written by hand may order its keys as it likes).
pub fn compare(golden: Option<&str>, rendered: &str) -> Verdict {
    let Some(golden) = golden else {
        return Verdict::NoGolden;
    };
    let rendered: Value = match serde_yaml_ng::from_str(rendered) {
        Ok(v) => v,
        Err(e) => return Verdict::Differs(format!("  the rendering is not YAML: {e}\n")),
    };
    let golden: Value = match serde_yaml_ng::from_str(golden) {
        Ok(v) => v,
        Err(e) => return Verdict::Differs(format!("  the golden file is not YAML: {e}\n")),
    };
    if golden == rendered {
        return Verdict::Same;
    }
    let mut out = String::new();
    for change in crate::diff::diff(&golden, &rendered) {
        let show = |v: &Option<Value>| match v {
            Some(v) => v.to_string(),
            None => "(absent)".into(),
        };
        let path = if change.path.is_empty() {
            "(the whole document)"
        } else {
            &change.path
        };
        let _ = writeln!(
            out,
            "  {path}: {} -> {}",
            show(&change.old),
            show(&change.new)
        );
    }
    Verdict::Differs(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_the_yaml_files_that_are_not_companions() {
        let dir = tempfile::tempdir().unwrap();
        for f in [
            "b.yaml",
            "a.yaml",
            "a.golden.yaml",
            "a.observed.yaml",
            "b.related.yaml",
            "b.old.yaml",
            "notes.txt",
        ] {
            std::fs::write(dir.path().join(f), "").unwrap();
        }
        let samples = find(dir.path()).unwrap();
        let names: Vec<&str> = samples.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(
            samples[0].observed,
            Some(dir.path().join("a.observed.yaml"))
        );
        assert_eq!(samples[0].related, None);
        assert_eq!(samples[1].related, Some(dir.path().join("b.related.yaml")));
        assert_eq!(samples[1].old, Some(dir.path().join("b.old.yaml")));
        assert_eq!(samples[0].old, None);
        assert_eq!(samples[1].golden, dir.path().join("b.golden.yaml"));

        let empty = tempfile::tempdir().unwrap();
        let err = find(empty.path()).unwrap_err().to_string();
        assert!(err.contains("no samples"), "{err}");
    }

    #[test]
    fn a_comparison_is_of_objects_and_names_each_field_that_differs() {
        let rendered = "status:\n  phase: Pending\n  configMap: x\n";
        assert_eq!(compare(None, rendered), Verdict::NoGolden);
        assert_eq!(
            compare(Some("status: {configMap: x, phase: Pending}\n"), rendered),
            Verdict::Same
        );
        let Verdict::Differs(diff) = compare(Some("status:\n  phase: Ready\n"), rendered) else {
            panic!("differs");
        };
        assert_eq!(
            diff,
            "  status.configMap: (absent) -> \"x\"\n  status.phase: \"Ready\" -> \"Pending\"\n"
        );
        let Verdict::Differs(diff) = compare(Some("status: [\n"), rendered) else {
            panic!("differs");
        };
        assert!(diff.contains("the golden file is not YAML"), "{diff}");
    }
}
