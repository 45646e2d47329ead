//! Plugin projects outside the repository, as their authors make them: `capstan new` in
//! an empty directory, depending on the SDK packages `cargo xtask sdks` wrote (by name
//! and version, through `--sdks`, never a path into the repository); `capstan build`
//! with the pinned toolchain; `capstan test` against the golden file `new` wrote; then a
//! golden file that no longer matches (a readable difference, exit 1), `--update`, and a
//! sample the plugin refuses. The same for Rust, Python and TypeScript.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::assert_fails_with;

/// target/sdks, which `cargo xtask sdks` writes (and `cargo xtask test` names in
/// CAPSTAN_SDKS).
fn sdks() -> PathBuf {
    let dir = std::env::var_os("CAPSTAN_SDKS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/sdks"));
    assert!(
        dir.join("capstan-sdk-0.2.0.tgz").is_file(),
        "{} has no SDK packages: run `cargo xtask sdks` (or every test with `cargo xtask test`)",
        dir.display()
    );
    dir
}

fn capstan_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_capstan"))
        .args(args)
        .current_dir(dir)
        .env_remove("CAPSTAN_LOG")
        // The projects are made under this repository's target/, whose .cargo/config.toml
        // would send a Rust project's build into the repository's target directory: its
        // own, as anywhere else.
        .env("CARGO_TARGET_DIR", "target")
        .output()
        .expect("run capstan")
}

fn ok(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `capstan new NAME --lang LANG --sdks …` in a fresh directory of its own, then
/// build, test, a changed golden file, `--update`, a refused sample.
fn new_build_test(lang: &str) {
    let name = format!("banner-{lang}");
    let parent = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("new-{lang}"));
    // A Rust project's target/ survives from the last run (the SDK's dependencies
    // compiled for wasm32-wasip2 take a minute or two); everything else is new.
    let kept = parent.with_extension("target");
    let target = parent.join(&name).join("target");
    if target.is_dir() {
        let _ = std::fs::remove_dir_all(&kept);
        std::fs::rename(&target, &kept).unwrap();
    }
    let _ = std::fs::remove_dir_all(&parent);
    std::fs::create_dir_all(&parent).unwrap();

    let sdks = sdks();
    let said = ok(
        capstan_in(
            &parent,
            &[
                "new",
                &name,
                "--lang",
                lang,
                "--sdks",
                sdks.to_str().unwrap(),
            ],
        ),
        "capstan new",
    );
    let project = parent.join(&name);
    assert!(said.contains(&format!("created ./{name}")), "{said}");
    for file in [
        "capstan.toml",
        "README.md",
        "samples/banner-LANG.yaml",
        "samples/banner-LANG.golden.yaml",
    ] {
        let file = file.replace("LANG", lang);
        assert!(project.join(&file).is_file(), "capstan new wrote no {file}");
    }
    if kept.is_dir() {
        std::fs::rename(&kept, &target).unwrap();
    }

    // build: the component's path on stdout, nothing else.
    let built = ok(capstan_in(&project, &["build"]), "capstan build");
    let wasm = project.join(built.trim());
    let bytes = std::fs::read(&wasm).unwrap_or_else(|e| panic!("{}: {e}", wasm.display()));
    assert!(
        bytes.starts_with(b"\0asm\x0d\x00\x01\x00"),
        "{} is not a component",
        wasm.display()
    );

    // The CRD is shipped through the SDK.
    let crd = ok(
        capstan_in(&project, &["crd", wasm.to_str().unwrap()]),
        "capstan crd",
    );
    let crd: serde_json::Value = serde_yaml_ng::from_str(&crd).unwrap();
    let plural = format!("banner{lang}s");
    assert_eq!(crd["metadata"]["name"], format!("{plural}.example.com"));

    // test: the golden file `new` wrote matches what the plugin renders.
    let tested = ok(capstan_in(&project, &["test"]), "capstan test");
    assert!(
        tested.contains("1 samples: all match their golden files"),
        "{tested}"
    );

    // A golden file that says something else: exit 1, the field that differs.
    let golden = project.join(format!("samples/{name}.golden.yaml"));
    let text = std::fs::read_to_string(&golden).unwrap();
    std::fs::write(&golden, text.replace("Hello from Capstan", "Goodbye")).unwrap();
    let out = capstan_in(&project, &["test"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("FAILED"), "{said}");
    assert!(
        said.contains(r#"children[0].data.message: "Goodbye" -> "Hello from Capstan""#),
        "{said}"
    );

    // A sample the plugin refuses, without a golden file yet: a failure until --update
    // writes the refusal into it.
    let refused = project.join("samples/empty.yaml");
    let sample = std::fs::read_to_string(project.join(format!("samples/{name}.yaml"))).unwrap();
    std::fs::write(
        &refused,
        sample.replace("message: Hello from Capstan", "message: \"\""),
    )
    .unwrap();
    let out = capstan_in(&project, &["test"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("no golden file"), "{said}");

    let updated = ok(
        capstan_in(&project, &["test", "--update"]),
        "capstan test --update",
    );
    assert!(updated.contains("2 golden files written"), "{updated}");
    assert_eq!(
        std::fs::read_to_string(&golden).unwrap(),
        text,
        "--update restores what it renders"
    );
    let error = std::fs::read_to_string(project.join("samples/empty.golden.yaml")).unwrap();
    assert!(
        error.starts_with("error: ")
            && error.contains("spec.message: a non-empty string is required"),
        "{error}"
    );
    let tested = ok(
        capstan_in(&project, &["test"]),
        "capstan test after --update",
    );
    assert!(
        tested.contains("2 samples: all match their golden files"),
        "{tested}"
    );

    if let Some((file, bug, said)) = bug_in(lang, &name) {
        // A bug: the log names the author's source file and line, not the bundle's or
        // the component's paths, and does not call a caught exception uncaught.
        let path = project.join(&file);
        let source = std::fs::read_to_string(&path).unwrap();
        let (anchor, injected) = bug;
        assert!(source.contains(anchor), "{file} has no {anchor:?}");
        let source = source.replacen(anchor, &format!("{anchor}{injected}"), 1);
        std::fs::write(&path, &source).unwrap();
        // The line that throws: the last line of the injected code.
        let line = source[..source.find(injected).unwrap() + injected.len()]
            .lines()
            .count();
        ok(capstan_in(&project, &["build"]), "capstan build with a bug");
        let boom = project.join("boom.yaml");
        std::fs::write(&boom, sample.replace("Hello from Capstan", "boom")).unwrap();
        let out = capstan_in(
            &project,
            &[
                "render",
                "--plugin",
                wasm.to_str().unwrap(),
                "--parent",
                boom.to_str().unwrap(),
            ],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        let at = said.replace("LINE", &line.to_string());
        assert!(
            stderr.contains(&at),
            "the log should name {at:?}:\n{stderr}"
        );
        for noise in ["uncaught", "plugin.js:", "\"/0/", ".wasm.build"] {
            assert!(!stderr.contains(noise), "{noise:?} in:\n{stderr}");
        }
        assert!(
            stderr
                .lines()
                .last()
                .unwrap()
                .starts_with("capstan: reconcile failed"),
            "{stderr}"
        );
    }
}

#[test]
fn a_rust_project_is_made_built_and_tested_outside_the_repository() {
    new_build_test("rust");
}

#[test]
fn a_python_project_is_made_built_and_tested_outside_the_repository() {
    new_build_test("python");
}

#[test]
fn a_typescript_project_is_made_built_and_tested_outside_the_repository() {
    new_build_test("typescript");
}

#[test]
fn bad_input_to_new_build_and_test_is_one_line_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    std::fs::create_dir(dir.path().join("taken")).unwrap();
    let run = |args: &[&str], expected: &str| {
        let out = capstan_in(dir.path(), args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    };
    run(&["new", "taken", "--lang", "rust"], "already exists");
    run(&["new", "Bad_Name", "--lang", "rust"], "invalid name");
    run(
        &["new", "ok", "--lang", "rust", "--group", "nodot"],
        "invalid group",
    );
    run(
        &["new", "ok", "--lang", "python", "--sdks", d],
        "cargo xtask sdks",
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["taken"], "nothing was written");
    // Not a project: build and test say so (the same checks as every command's errors).
    assert_fails_with(&["build", d], "has no capstan.toml");
    assert_fails_with(&["test", d], "has no capstan.toml");
}

/// Where to put a bug in a new project of `lang` (after which anchor, what), and what
/// the log must then say (`LINE`: the line that throws).
fn bug_in(lang: &str, name: &str) -> Option<(String, (&'static str, &'static str), String)> {
    let module = name.replace('-', "_");
    match lang {
        "typescript" => Some((
            "src/plugin.ts".into(),
            (
                "    const spec = ctx.spec(parseSpec);\n",
                "    if (spec.message === 'boom') JSON.parse('{not json');\n",
            ),
            "reconcile@src/plugin.ts:LINE:".into(),
        )),
        "python" => Some((
            format!("{module}/__init__.py"),
            (
                "        exists = ctx.child(CONFIG_MAP, name) is not None\n",
                "        if message == \"boom\":\n            raise KeyError(message)\n",
            ),
            format!("File \"{module}/__init__.py\", line LINE"),
        )),
        _ => None,
    }
}
