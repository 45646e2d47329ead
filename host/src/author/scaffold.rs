//! `capstan new`: a plugin project from a template, in Rust, Python or TypeScript.
//!
//! Every project holds the plugin (one ConfigMap child and a status), its CRD shipped
//! through the SDK, a sample parent with the golden file of what it renders, a README
//! and a `capstan.toml`. It depends on the SDK by name and version
//! ([`SDK_VERSION`](super::SDK_VERSION)); with `--sdks DIR` on the packages in DIR
//! instead (what `cargo xtask sdks` writes), as a project would before the SDK is
//! published.

use std::path::{Path, PathBuf};

use super::{IoContext, Result, invalid};
use serde_json::{Value, json};

use super::project::MANIFEST;
use super::{Language, SDK_VERSION};

/// What `capstan new` was asked for.
#[derive(Debug, Clone)]
pub struct NewOptions {
    /// The project's and the plugin's name (a directory of that name is made).
    pub name: String,
    /// Its language.
    pub language: Language,
    /// The parent kind's API group.
    pub group: String,
    /// Its version.
    pub version: String,
    /// The kind (default: the name in CamelCase).
    pub kind: Option<String>,
    /// Take the SDK from this directory of packages instead of the public registry.
    pub sdks: Option<PathBuf>,
}

/// The names of one project, all derived from the options.
#[derive(Debug, Clone)]
struct Names {
    name: String,
    /// `name` with `_` for `-`: the Rust crate's and Python module's name.
    ident: String,
    group: String,
    version: String,
    kind: String,
    plural: String,
    singular: String,
}

/// Makes `<parent>/<name>`, returning its path. Nothing is written unless everything
/// is: the project is made beside its place and renamed into it.
pub fn create(parent: &Path, options: &NewOptions) -> Result<PathBuf> {
    let names = names(options)?;
    let sdks = options.sdks.as_deref().map(sdk_dir).transpose()?;
    if let Some(dir) = &sdks {
        check_sdk_package(dir, options.language)?;
    }
    let dest = parent.join(&names.name);
    if dest.exists() {
        invalid!(
            "{} already exists: `capstan new` never writes over anything",
            dest.display()
        );
    }
    // The SDKs are not on crates.io, PyPI or npm yet: a project that named
    // `capstan-sdk` or `@capstan/sdk` there would build whatever anyone registers under
    // that name (dependency confusion). So the project takes them from local packages.
    if sdks.is_none() {
        invalid!(
            "the Capstan SDKs are not published yet: pass --sdks DIR, a directory of the SDK packages (`cargo xtask sdks` writes them into target/sdks), so that the project depends on no name anyone could register"
        );
    }
    let files = files(&names, options.language, sdks.as_deref())?;
    let tmp = parent.join(format!(".{}.new-{}", names.name, std::process::id()));
    let written = (|| -> Result<()> {
        for (path, text) in &files {
            let path = tmp.join(path);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).doing(|| format!("create {}", dir.display()))?;
            }
            std::fs::write(&path, text).doing(|| format!("write {}", path.display()))?;
        }
        std::fs::rename(&tmp, &dest).doing(|| format!("create {}", dest.display()))
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    Ok(dest)
}

fn names(options: &NewOptions) -> Result<Names> {
    let name = &options.name;
    let name_ok = (1..=40).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && !name.ends_with('-')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if !name_ok {
        invalid!(
            "invalid name {name:?}: use 1 to 40 lower-case letters, digits and '-', starting with a letter (such as banner or my-app)"
        );
    }
    let ident = name.replace('-', "_");
    // Names the project's own files or its SDK already take.
    if ["capstan", "capstan_sdk", "app", "test", "tests", "crd"].contains(&ident.as_str()) {
        invalid!("invalid name {name:?}: it is taken by the SDK or the project's own files");
    }
    // A keyword is no crate name (cargo refuses it) and no module one (`from class
    // import …` does not parse).
    if KEYWORDS.contains(&ident.as_str()) {
        invalid!("invalid name {name:?}: it is a Rust or Python keyword");
    }
    let kind = match &options.kind {
        Some(kind) => kind.clone(),
        None => name
            .split('-')
            .filter(|part| !part.is_empty())
            .map(|part| {
                let mut chars = part.chars();
                chars
                    .next()
                    .map(|c| c.to_ascii_uppercase().to_string() + chars.as_str())
                    .unwrap_or_default()
            })
            .collect(),
    };
    let kind_ok = (1..=63).contains(&kind.len())
        && kind.starts_with(|c: char| c.is_ascii_uppercase())
        && kind.chars().all(|c| c.is_ascii_alphanumeric());
    if !kind_ok {
        invalid!(
            "invalid kind {kind:?}: use CamelCase letters and digits, starting with an upper-case letter (such as Banner)"
        );
    }
    let group = &options.group;
    let label = |l: &str| {
        (1..=63).contains(&l.len())
            && l.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if group.len() > 253 || !group.contains('.') || !group.split('.').all(label) {
        invalid!(
            "invalid group {group:?}: use a lower-case DNS name with a dot, such as example.com"
        );
    }
    if ["k8s.io", "kubernetes.io"]
        .iter()
        .any(|g| group == g || group.ends_with(&format!(".{g}")))
    {
        invalid!(
            "invalid group {group:?}: groups under k8s.io and kubernetes.io are reserved for Kubernetes' own APIs"
        );
    }
    let version = &options.version;
    if !is_api_version(version) {
        invalid!("invalid version {version:?}: use v1, v2, v1beta1, v1alpha2 and the like");
    }
    let singular = kind.to_ascii_lowercase();
    Ok(Names {
        name: name.clone(),
        ident,
        group: group.clone(),
        version: version.clone(),
        plural: plural_of(&singular),
        singular,
        kind,
    })
}

/// The Rust and Python keywords a lower-case name can spell.
const KEYWORDS: &[&str] = &[
    // Rust (strict and reserved).
    "as", "async", "await", "break", "const", "continue", "crate", "dyn", "else", "enum", "extern",
    "false", "fn", "for", "if", "impl", "in", "let", "loop", "match", "mod", "move", "mut", "pub",
    "ref", "return", "self", "static", "struct", "super", "trait", "true", "type", "unsafe", "use",
    "where", "while", "abstract", "become", "box", "do", "final", "gen", "macro", "override",
    "priv", "try", "typeof", "unsized", "virtual", "yield",
    // Python (those not above).
    "and", "assert", "class", "def", "del", "elif", "except", "finally", "from", "global", "import",
    "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "with",
];

/// `v1`, `v2beta1`, `v1alpha3`: what Kubernetes accepts as a version it can order.
fn is_api_version(v: &str) -> bool {
    let Some(rest) = v.strip_prefix('v') else {
        return false;
    };
    let digits =
        |s: &str| !s.is_empty() && !s.starts_with('0') && s.chars().all(|c| c.is_ascii_digit());
    let major_end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let (major, tail) = rest.split_at(major_end);
    if !digits(major) {
        return false;
    }
    tail.is_empty()
        || ["alpha", "beta"]
            .iter()
            .any(|stage| tail.strip_prefix(stage).is_some_and(digits))
}

/// The English plural Kubernetes' own kinds follow (`policy` -> `policies`, `box` ->
/// `boxes`); the CRD can be edited for another.
fn plural_of(singular: &str) -> String {
    if let Some(stem) = singular.strip_suffix('y')
        && !stem.ends_with(['a', 'e', 'i', 'o', 'u'])
    {
        return format!("{stem}ies");
    }
    if ["s", "x", "z", "ch", "sh"]
        .iter()
        .any(|e| singular.ends_with(e))
    {
        return format!("{singular}es");
    }
    format!("{singular}s")
}

/// The `--sdks` directory, absolute (the project names it in its manifests).
fn sdk_dir(dir: &Path) -> Result<PathBuf> {
    std::fs::canonicalize(dir).doing(|| format!("--sdks {}", dir.display()))
}

/// The package `--sdks` must hold for `language`, and where the project points.
fn sdk_package(dir: &Path, language: Language) -> PathBuf {
    match language {
        Language::Rust => dir.join(format!("capstan-sdk-{SDK_VERSION}")),
        Language::Python => dir.join(format!("capstan_sdk-{SDK_VERSION}-py3-none-any.whl")),
        Language::Typescript => dir.join(format!("capstan-sdk-{SDK_VERSION}.tgz")),
    }
}

fn check_sdk_package(dir: &Path, language: Language) -> Result<()> {
    let package = sdk_package(dir, language);
    let there = match language {
        Language::Rust => package.join("Cargo.toml").is_file(),
        _ => package.is_file(),
    };
    if !there {
        invalid!(
            "--sdks {}: no {} there (`cargo xtask sdks` writes the SDK packages into target/sdks)",
            dir.display(),
            package.file_name().unwrap_or_default().to_string_lossy()
        );
    }
    Ok(())
}

/// The Rust release of this repository's rust-toolchain.toml, which the Rust SDK is
/// tested with: a Rust project pins it too.
fn rust_channel() -> &'static str {
    const TOOLCHAIN: &str = include_str!("../../../rust-toolchain.toml");
    TOOLCHAIN
        .lines()
        .find_map(|l| l.strip_prefix("channel = \""))
        .and_then(|l| l.strip_suffix('"'))
        .unwrap_or("stable")
}

/// Every file of the project: (path, text).
fn files(n: &Names, language: Language, sdks: Option<&Path>) -> Result<Vec<(String, String)>> {
    let crd = crd(n);
    let (build_command, output, source, crd_file, prerequisites) = match language {
        Language::Rust => (
            "cargo build --release --target wasm32-wasip2".to_string(),
            format!("target/wasm32-wasip2/release/{}.wasm", n.ident),
            "src/lib.rs",
            "src/crd.json",
            "\nIt needs rustup (https://rustup.rs); `rust-toolchain.toml` pins the Rust release and\nthe wasm32-wasip2 target. For unit tests in plain Rust,\n`capstan_sdk::testing::observe_for` makes a plugin's context from JSON objects.",
        ),
        Language::Python => (
            format!(
                "python -m pip install --quiet --disable-pip-version-check --upgrade --target .capstan/python -r requirements.txt && mkdir -p build && componentize-py -d .capstan/python/capstan/wit -w plugin componentize -p . -p .capstan/python app -o build/{}.wasm",
                n.name
            ),
            format!("build/{}.wasm", n.name),
            "__MODULE__/__init__.py",
            "__MODULE__/crd.py",
            "\nIt needs Python 3.9 or later with venv; the SDK (`capstan-sdk`, module `capstan`)\nis installed into `.capstan/python` from requirements.txt.",
        ),
        Language::Typescript => (
            format!(
                "npm install --no-audit --no-fund --ignore-scripts --silent && capstan-js check . && capstan-js component . build/{}.wasm",
                n.name
            ),
            format!("build/{}.wasm", n.name),
            "src/plugin.ts",
            "src/crd.ts",
            "\nIt needs Node.js 20 or later with npm; `npm install` brings `@capstan/sdk`, and the\ntoolchain (componentize-js, esbuild, TypeScript) is Capstan's pinned one.",
        ),
    };
    let source = source.replace("__MODULE__", &n.ident);
    let crd_file = crd_file.replace("__MODULE__", &n.ident);
    let sdk = sdks.map(|dir| sdk_package(dir, language));
    let mut vars: Vec<(&'static str, String)> = vec![
        ("name", n.name.clone()),
        ("module", n.ident.clone()),
        ("group", n.group.clone()),
        ("version", n.version.clone()),
        ("kind", n.kind.clone()),
        ("plural", n.plural.clone()),
        ("singular", n.singular.clone()),
        ("sdk_version", SDK_VERSION.into()),
        ("language", language.id().into()),
        ("language_name", language.display_name().into()),
        // A TOML basic string's contents.
        (
            "build_command",
            build_command.replace('\\', "\\\\").replace('"', "\\\""),
        ),
        ("output", output.clone()),
        ("source", format!("`{source}`")),
        ("crd_file", format!("`{crd_file}`")),
        ("prerequisites", prerequisites.into()),
        ("rust_channel", rust_channel().into()),
    ];
    let golden = serde_yaml_ng::to_string(&golden(n))?;
    let mut files = vec![
        (
            MANIFEST.to_string(),
            include_str!("../../templates/capstan.toml"),
        ),
        (
            "README.md".to_string(),
            include_str!("../../templates/README.md"),
        ),
        (
            format!("samples/{}.yaml", n.name),
            include_str!("../../templates/sample.yaml"),
        ),
    ];
    let mut generated = vec![(format!("samples/{}.golden.yaml", n.name), golden)];
    let extra: Vec<(&'static str, String)> = match language {
        Language::Rust => {
            files.extend([
                (
                    "Cargo.toml".to_string(),
                    include_str!("../../templates/rust/Cargo.toml"),
                ),
                (
                    "rust-toolchain.toml".to_string(),
                    include_str!("../../templates/rust/rust-toolchain.toml"),
                ),
                (
                    "src/lib.rs".to_string(),
                    include_str!("../../templates/rust/src/lib.rs"),
                ),
            ]);
            generated.extend([
                (
                    "src/crd.json".to_string(),
                    serde_json::to_string_pretty(&crd)? + "\n",
                ),
                (".gitignore".to_string(), "/target\n".to_string()),
            ]);
            let patch = match &sdk {
                Some(dir) => format!(
                    "\n# `capstan new --sdks`: the SDK from a local package, not from crates.io.\n[patch.crates-io]\ncapstan-sdk = {{ path = {} }}\n",
                    toml_string(dir)?
                ),
                None => String::new(),
            };
            vec![("rust_patch", patch)]
        }
        Language::Python => {
            files.extend([
                (
                    "app.py".to_string(),
                    include_str!("../../templates/python/app.py"),
                ),
                (
                    format!("{}/__init__.py", n.ident),
                    include_str!("../../templates/python/module/__init__.py"),
                ),
            ]);
            let find_links = match &sdk {
                Some(wheel) => format!(
                    "# `capstan new --sdks`: the SDK from a local package, not from PyPI.\n--no-index\n--find-links {}\n",
                    wheel.parent().unwrap_or(wheel).display()
                ),
                None => String::new(),
            };
            generated.extend([
                (format!("{}/crd.py", n.ident), python_crd(n, &crd)),
                (
                    "requirements.txt".to_string(),
                    format!("# The Capstan SDK (module `capstan`), at the contract release this plugin builds for.\n{find_links}capstan-sdk=={SDK_VERSION}\n"),
                ),
                (".gitignore".to_string(), "/build\n/.capstan\n__pycache__/\n".to_string()),
            ]);
            vec![]
        }
        Language::Typescript => {
            files.extend([
                (
                    "package.json".to_string(),
                    include_str!("../../templates/typescript/package.json"),
                ),
                (
                    "tsconfig.json".to_string(),
                    include_str!("../../templates/typescript/tsconfig.json"),
                ),
                (
                    "src/index.ts".to_string(),
                    include_str!("../../templates/typescript/src/index.ts"),
                ),
                (
                    "src/plugin.ts".to_string(),
                    include_str!("../../templates/typescript/src/plugin.ts"),
                ),
            ]);
            generated.extend([
                (
                    "src/crd.ts".to_string(),
                    format!(
                        "// The {} CustomResourceDefinition, shipped in `describe`: `capstan crd` prints it\n// and `capstan run --install-crds` applies it.\n\nexport const crd = {};\n",
                        n.kind,
                        serde_json::to_string_pretty(&crd)?
                    ),
                ),
                (".gitignore".to_string(), "/node_modules\n/build\n".to_string()),
            ]);
            let spec = match &sdk {
                Some(tgz) => format!("file:{}", tgz.display()),
                None => SDK_VERSION.to_string(),
            };
            // A JSON string, without its quotes (the template has them).
            let spec = serde_json::to_string(&spec)?;
            vec![("ts_sdk", spec[1..spec.len() - 1].to_string())]
        }
    };
    vars.extend(extra);
    let mut out: Vec<(String, String)> = files
        .into_iter()
        .map(|(path, text)| (path, substitute(text, &vars)))
        .collect();
    out.extend(generated);
    for (path, text) in &out {
        if let Some(at) = text.find("{{") {
            let rest = &text[at..];
            invalid!(
                "template {path}: unknown placeholder {}",
                &rest[..rest.find("}}").map(|e| e + 2).unwrap_or(rest.len())]
            );
        }
    }
    Ok(out)
}

/// `{{key}}` replaced by its value, for every key.
fn substitute(text: &str, vars: &[(&str, String)]) -> String {
    let mut text = text.to_string();
    for (key, value) in vars {
        text = text.replace(&format!("{{{{{key}}}}}"), value);
    }
    text
}

/// A path as a TOML basic string.
fn toml_string(path: &Path) -> Result<String> {
    let Some(text) = path.to_str() else {
        invalid!("{} is not UTF-8", path.display());
    };
    Ok(serde_json::to_string(text)?)
}

/// The parent kind's CRD: the `message` spec field, the status the plugin writes and
/// the conditions the host adds, with the status subresource and a Phase column.
fn crd(n: &Names) -> Value {
    let condition = json!({
        "type": "object",
        "required": ["type", "status", "lastTransitionTime", "reason", "message"],
        "properties": {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "observedGeneration": {"type": "integer", "format": "int64"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "reason": {"type": "string"},
            "message": {"type": "string"}
        }
    });
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{}.{}", n.plural, n.group)},
        "spec": {
            "group": n.group,
            "scope": "Namespaced",
            "names": {
                "kind": n.kind,
                "listKind": format!("{}List", n.kind),
                "plural": n.plural,
                "singular": n.singular
            },
            "versions": [{
                "name": n.version,
                "served": true,
                "storage": true,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
                ],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "spec": {
                            "type": "object",
                            "required": ["message"],
                            "properties": {
                                "message": {"type": "string", "minLength": 1, "description": "What the ConfigMap holds."}
                            }
                        },
                        "status": {
                            "type": "object",
                            "properties": {
                                "phase": {"type": "string"},
                                "configMap": {"type": "string"},
                                "observedGeneration": {"type": "integer", "format": "int64"},
                                "conditions": {
                                    "type": "array",
                                    "x-kubernetes-list-type": "map",
                                    "x-kubernetes-list-map-keys": ["type"],
                                    "items": condition
                                }
                            }
                        }
                    }
                }}
            }]
        }
    })
}

/// What the sample (`hello`, never reconciled, its ConfigMap not there yet) renders to
/// at the test clock: the golden file `capstan new` writes.
fn golden(n: &Names) -> Value {
    let config_map = format!("hello-{}", n.singular);
    let time = super::samples::CLOCK;
    json!({
        "children": [{
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": config_map,
                "namespace": "default",
                "labels": {
                    "app.kubernetes.io/managed-by": "capstan",
                    "app.kubernetes.io/part-of": "hello",
                    "capstan.dev/plugin": n.name,
                    "capstan.dev/shard-bucket": crate::shard::bucket_of(crate::render::SAMPLE_UID).to_string()
                },
                "ownerReferences": [{
                    "apiVersion": format!("{}/{}", n.group, n.version),
                    "kind": n.kind,
                    "name": "hello",
                    "uid": crate::render::SAMPLE_UID,
                    "controller": true,
                    "blockOwnerDeletion": true
                }]
            },
            "data": {"message": "Hello from Capstan"}
        }],
        "events": [],
        "status": {
            "phase": "Pending",
            "configMap": config_map,
            "observedGeneration": 1,
            "conditions": [
                {
                    "type": "ConfigMapReady",
                    "status": "False",
                    "reason": "Created",
                    "message": format!("ConfigMap {config_map} was asked for"),
                    "observedGeneration": 1,
                    "lastTransitionTime": time
                },
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Reconciled",
                    "message": "1 child applied",
                    "observedGeneration": 1,
                    "lastTransitionTime": time
                }
            ]
        }
    })
}

/// The CRD as a Python module: a dict literal and its JSON, which `crd=` takes.
fn python_crd(n: &Names, crd: &Value) -> String {
    let mut literal = String::new();
    python_literal(crd, 0, &mut literal);
    format!(
        "\"\"\"The {} CustomResourceDefinition, shipped in ``describe``: ``capstan crd`` prints it\nand ``capstan run --install-crds`` applies it.\"\"\"\n\nimport json\n\nCRD = {literal}\n\nCRD_JSON = json.dumps(CRD)\n",
        n.kind
    )
}

/// A JSON value as a Python literal, four spaces per level.
fn python_literal(value: &Value, depth: usize, out: &mut String) {
    let pad = |d: usize| "    ".repeat(d);
    match value {
        Value::Null => out.push_str("None"),
        Value::Bool(true) => out.push_str("True"),
        Value::Bool(false) => out.push_str("False"),
        // JSON strings and numbers are Python literals as they are.
        Value::Number(_) | Value::String(_) => out.push_str(&value.to_string()),
        Value::Array(items) if items.iter().all(|v| !v.is_object() && !v.is_array()) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_literal(item, depth, out);
            }
            out.push(']');
        }
        Value::Array(items) => {
            out.push_str("[\n");
            for item in items {
                out.push_str(&pad(depth + 1));
                python_literal(item, depth + 1, out);
                out.push_str(",\n");
            }
            out.push_str(&pad(depth));
            out.push(']');
        }
        Value::Object(map) if map.is_empty() => out.push_str("{}"),
        Value::Object(map) => {
            out.push_str("{\n");
            for (key, v) in map {
                out.push_str(&pad(depth + 1));
                out.push_str(&Value::String(key.clone()).to_string());
                out.push_str(": ");
                python_literal(v, depth + 1, out);
                out.push_str(",\n");
            }
            out.push_str(&pad(depth));
            out.push('}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(name: &str, language: Language) -> NewOptions {
        NewOptions {
            name: name.into(),
            language,
            group: "example.com".into(),
            version: "v1".into(),
            kind: None,
            sdks: None,
        }
    }

    #[test]
    fn names_are_derived_and_checked() {
        let n = names(&options("my-app", Language::Rust)).unwrap();
        assert_eq!(
            (n.kind.as_str(), n.plural.as_str(), n.ident.as_str()),
            ("MyApp", "myapps", "my_app")
        );
        for (singular, plural) in [
            ("policy", "policies"),
            ("box", "boxes"),
            ("key", "keys"),
            ("banner", "banners"),
        ] {
            assert_eq!(plural_of(singular), plural);
        }
        for v in ["v1", "v2beta1", "v1alpha3", "v10"] {
            assert!(is_api_version(v), "{v}");
        }
        for v in ["1", "v0", "v1gamma1", "v1beta", "v1beta0", "V1", "v01"] {
            assert!(!is_api_version(v), "{v}");
        }
        let bad = |o: NewOptions, says: &str| {
            let err = names(&o).unwrap_err().to_string();
            assert!(err.contains(says) && !err.contains('\n'), "{o:?}: {err}");
        };
        bad(options("Banner", Language::Rust), "invalid name");
        bad(options("my_app", Language::Rust), "invalid name");
        bad(options("app", Language::Python), "taken");
        bad(options("capstan", Language::Rust), "taken");
        bad(options("class", Language::Python), "keyword");
        bad(options("self", Language::Rust), "keyword");
        bad(
            NewOptions {
                kind: Some("banner".into()),
                ..options("b", Language::Rust)
            },
            "invalid kind",
        );
        bad(
            NewOptions {
                group: "example".into(),
                ..options("b", Language::Rust)
            },
            "invalid group",
        );
        bad(
            NewOptions {
                group: "x.k8s.io".into(),
                ..options("b", Language::Rust)
            },
            "reserved",
        );
        bad(
            NewOptions {
                version: "1.0".into(),
                ..options("b", Language::Rust)
            },
            "invalid version",
        );
    }

    #[test]
    fn every_language_fills_every_placeholder() {
        for language in [Language::Rust, Language::Python, Language::Typescript] {
            let n = names(&options("banner", language)).unwrap();
            let files = files(&n, language, None).unwrap();
            let manifest = &files.iter().find(|(p, _)| p == MANIFEST).unwrap().1;
            let parsed: super::super::project::Manifest = toml::from_str(manifest).unwrap();
            assert_eq!(parsed.plugin.language, language);
            assert!(files.iter().any(|(p, _)| p == "samples/banner.golden.yaml"));
        }
    }

    #[test]
    fn the_python_crd_is_the_same_object_as_the_json_one() {
        let n = names(&options("banner", Language::Python)).unwrap();
        let mut literal = String::new();
        python_literal(&crd(&n), 0, &mut literal);
        assert!(
            literal.contains("\"served\": True") && !literal.contains("true"),
            "{literal}"
        );
    }

    #[test]
    fn an_existing_directory_or_a_missing_sdk_package_writes_nothing() {
        let parent = tempfile::tempdir().unwrap();
        std::fs::create_dir(parent.path().join("banner")).unwrap();
        let err = create(parent.path(), &options("banner", Language::Rust))
            .unwrap_err()
            .to_string();
        assert!(err.contains("already exists"), "{err}");

        // Without --sdks the project would depend on names nobody has published yet.
        let err = create(parent.path(), &options("unpublished", Language::Python))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not published yet: pass --sdks DIR") && !err.contains('\n'),
            "{err}"
        );

        let sdks = tempfile::tempdir().unwrap();
        let o = NewOptions {
            sdks: Some(sdks.path().into()),
            ..options("other", Language::Typescript)
        };
        let err = create(parent.path(), &o).unwrap_err().to_string();
        assert!(
            err.contains("no capstan-sdk-0.2.0.tgz") && err.contains("cargo xtask sdks"),
            "{err}"
        );
        let left: Vec<_> = std::fs::read_dir(parent.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["banner"], "nothing else was written");
    }
}
