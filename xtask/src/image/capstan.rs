//! The `capstan` image: the release host (or, for the tests, their build of it; see
//! [`Host`]), the shipped plugins, their code compiled at
//! build time, and what the host needs to run (its shared libraries, a non-root user) —
//! the contents of `gcr.io/distroless/cc-debian12:nonroot` that it uses, nothing more.
//!
//! deploy/Dockerfile builds the same image with Docker; [`CONTENT`], [`ENTRYPOINT`],
//! [`USER`] and [`ENV`] are the definition both follow, and a test below fails when the
//! Dockerfile says otherwise.
//!
//! The compiled code ([`PRECOMPILED`], `capstan precompile`) is for the build machine's
//! CPU and this wasmtime. The host looks there for an entry its compile cache lacks
//! (`CAPSTAN_PRECOMPILED_DIR`), under a name that carries the engine's compatibility
//! hash (CPU features included), and copies it into the cache, so a Pod on a node like
//! the build machine starts without compiling (no compile's memory peak); on another
//! CPU the names differ and the plugins compile as before.

use std::path::Path;

use anyhow::{Context, Result, bail};

use super::{fresh_dir, images_dir, in_root, make_dir, run_isolated, write_file};
use crate::{TestPlugins, build_host, build_plugins, build_release, oci, run_cmd, target_dir};

/// What the image holds from the build: (path under the target directory, path in the
/// image). A trailing `/` copies a directory's files.
pub const CONTENT: &[(&str, &str)] = &[
    ("release/capstan", "/usr/local/bin/capstan"),
    ("plugins/", "/opt/capstan/plugins/"),
    ("compiled/", "/opt/capstan/compiled/"),
];
/// The compiled plugins in the image (an entry of [`CONTENT`]).
pub const PRECOMPILED: &str = "/opt/capstan/compiled";
pub const ENTRYPOINT: &[&str] = &["/usr/local/bin/capstan"];
/// The CA bundle the image carries (where distroless has it, and rustls looks).
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// distroless's `nonroot`.
pub const USER: &str = "65532:65532";
/// The image's own environment (the Dockerfile's `ENV`s).
pub const ENV: &[(&str, &str)] = &[("CAPSTAN_PRECOMPILED_DIR", PRECOMPILED)];
/// What the Dockerfile's base image sets and this image sets too.
const BASE_ENV: &[(&str, &str)] = &[(
    "PATH",
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
)];

/// The image's name: the one deploy/base/deployment.yaml runs.
pub fn name() -> String {
    format!("capstan:{}", env!("CARGO_PKG_VERSION"))
}

/// Which build of the host goes into the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Host {
    /// `cargo build --release` (thin LTO): what `cargo xtask image` ships and
    /// deploy/Dockerfile builds.
    Release,
    /// The test build `cargo xtask test` has made already (`cargo test --no-run`: the
    /// dependencies, wasmtime and kube among them, at opt-level 2, the host's own code
    /// unoptimized). The image is assembled by the same code from the same content;
    /// only the binary differs, and the tests do not compile wasmtime a second time for
    /// it (about 17 minutes of a cold CI run, 8 for every host change on a warm one).
    Test,
}

impl Host {
    /// The binary's path under the target directory.
    fn binary(self) -> &'static str {
        match self {
            Host::Release => CONTENT[0].0,
            Host::Test => "debug/capstan",
        }
    }
}

/// Builds the host (`host`) and the shipped plugins, compiles the plugins, and writes
/// the image to target/images/capstan-<version>.tar.
pub fn build(host: Host) -> Result<oci::Image> {
    match host {
        Host::Release => {
            build_release()?;
        }
        Host::Test => {
            build_host()?;
        }
    }
    let binary = target_dir().join(host.binary());
    let plugins = build_plugins(TestPlugins::None)?.plugins;
    let compiled = target_dir().join("compiled");
    fresh_dir(&compiled)?;
    run_cmd(
        std::process::Command::new(&binary)
            .arg("precompile")
            .arg(&plugins)
            .arg(&compiled),
    )?;
    let rootfs = images_dir().join("capstan-rootfs");
    fresh_dir(&rootfs)?;
    assemble(&rootfs, host)?;
    check(&rootfs)?;
    let config = oci::ImageConfig {
        name: name(),
        entrypoint: ENTRYPOINT.iter().map(|s| s.to_string()).collect(),
        env: BASE_ENV
            .iter()
            .chain(ENV)
            .map(|(k, v)| format!("{k}={v}"))
            .collect(),
        user: Some(USER.into()),
        workdir: Some("/home/nonroot".into()),
        labels: vec![(
            "org.opencontainers.image.source".into(),
            "deploy/Dockerfile (built by cargo xtask image)".into(),
        )],
        ..oci::ImageConfig::default()
    };
    let out = images_dir().join(format!("capstan-{}.tar", env!("CARGO_PKG_VERSION")));
    oci::write_image(&[&rootfs], &config, &out)
}

/// Fills `rootfs` with [`CONTENT`], the host's shared libraries, the users and the
/// directories a distroless image has.
fn assemble(rootfs: &Path, host: Host) -> Result<()> {
    for (i, (from, to)) in CONTENT.iter().enumerate() {
        let from = target_dir().join(if i == 0 { host.binary() } else { from });
        if to.ends_with('/') {
            copy_dir_files(&from, &in_root(rootfs, to))?;
        } else {
            copy_file(&from, &in_root(rootfs, to))?;
        }
    }
    let binary = target_dir().join(host.binary());
    for lib in super::shared_libraries(&binary)? {
        copy_file(&lib, &in_root(rootfs, &lib.to_string_lossy()))?;
        // The libraries' licences go with them, as in Debian's images.
        if let Some(package) = super::debian_package(&lib) {
            let copyright = format!("/usr/share/doc/{package}/copyright");
            if Path::new(&copyright).is_file() {
                copy_file(Path::new(&copyright), &in_root(rootfs, &copyright))?;
            }
        }
    }
    // The CA roots distroless has (Debian's ca-certificates), for registries over HTTPS
    // (`--plugin oci://…`), with their licence.
    crate::cluster::ensure_debian_package(CA_BUNDLE, "ca-certificates")?;
    copy_file(Path::new(CA_BUNDLE), &in_root(rootfs, CA_BUNDLE))?;
    let copyright = "/usr/share/doc/ca-certificates/copyright";
    if Path::new(copyright).is_file() {
        copy_file(Path::new(copyright), &in_root(rootfs, copyright))?;
    }
    write_file(
        rootfs,
        "/etc/passwd",
        "root:x:0:0:root:/root:/sbin/nologin\n\
         nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
        0o644,
    )?;
    write_file(rootfs, "/etc/group", "root:x:0:\nnonroot:x:65532:\n", 0o644)?;
    write_file(rootfs, "/etc/nsswitch.conf", "hosts: files dns\n", 0o644)?;
    make_dir(rootfs, "/home/nonroot", 65532, 65532, 0o700)?;
    make_dir(rootfs, "/root", 0, 0, 0o700)?;
    make_dir(rootfs, "/tmp", 0, 0, 0o1777)?;
    // Mount points the runtime uses.
    make_dir(rootfs, "/proc", 0, 0, 0o555)?;
    make_dir(rootfs, "/dev", 0, 0, 0o755)?;
    Ok(())
}

/// Runs the image's `capstan` with the image's environment, as the image's user, on
/// its root file system mounted read-only (as the Deployment runs it): it starts, and
/// it loads every plugin from the compiled code, with an empty cache (`--cache-dir` on
/// a tmpfs, as the Deployment's `emptyDir`) and without compiling.
fn check(rootfs: &Path) -> Result<()> {
    let script = format!(
        r#"root=$1
mount --bind "$root" "$root"
mount -o remount,bind,ro "$root"
mount -t proc proc "$root/proc"
mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
in_image() {{ env -i {env} HOME=/home/nonroot chroot --userspec={USER} "$root" "$@"; }}
in_image {binary} --version
in_image {binary} rbac --plugins /opt/capstan/plugins \
    --cache-dir /tmp/cache --log capstan=debug >/dev/null 2>"$root/tmp/log" || {{ cat "$root/tmp/log"; exit 1; }}
if grep -q 'cannot\|ignoring' "$root/tmp/log"; then cat "$root/tmp/log"; exit 1; fi
plugins=$(ls "$root/opt/capstan/plugins" | grep -c '[.]wasm$')
test "$(grep -c 'compile cache seeded' "$root/tmp/log")" -eq "$plugins" || {{ cat "$root/tmp/log"; exit 1; }}
test "$(grep -c 'compiled code taken from the cache' "$root/tmp/log")" -eq "$plugins" || {{ cat "$root/tmp/log"; exit 1; }}
echo "image: capstan checked in the rootfs (read-only, user {USER}): $plugins plugins loaded from their compiled code"
"#,
        binary = ENTRYPOINT[0],
        env = BASE_ENV
            .iter()
            .chain(ENV)
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" "),
    );
    run_isolated("check the capstan image", &script, &[rootfs])
}

fn copy_file(from: &Path, to: &Path) -> Result<()> {
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::copy(from, to)
        .with_context(|| format!("copy {} to {}", from.display(), to.display()))?;
    Ok(())
}

/// Copies the files of `from` (not its subdirectories, nor hidden files: temporary
/// names of builds) into `to`.
fn copy_dir_files(from: &Path, to: &Path) -> Result<()> {
    let mut copied = 0;
    for entry in std::fs::read_dir(from).with_context(|| format!("read {}", from.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        if entry.file_type()?.is_file() && !name.to_string_lossy().starts_with('.') {
            copy_file(&entry.path(), &to.join(&name))?;
            copied += 1;
        }
    }
    if copied == 0 {
        bail!("{} is empty", from.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The last stage of a Dockerfile, as this test reads it.
    #[derive(Debug, Default, PartialEq)]
    struct Stage {
        /// `COPY --from=build /src/target/X Y` as (X, Y).
        copies: Vec<(String, String)>,
        entrypoint: Vec<String>,
        user: String,
        env: Vec<(String, String)>,
    }

    fn last_stage(dockerfile: &str) -> Stage {
        // Continuation lines joined, comments dropped.
        let joined = dockerfile
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
            .replace("\\\n", " ");
        let lines: Vec<&str> = joined.lines().map(str::trim).collect();
        let last_from = lines
            .iter()
            .rposition(|l| l.starts_with("FROM "))
            .expect("a FROM");
        let mut stage = Stage::default();
        for line in &lines[last_from + 1..] {
            let (instruction, rest) = line.split_once(' ').unwrap_or((line, ""));
            let rest = rest.trim();
            match instruction {
                "COPY" => {
                    let words: Vec<&str> = rest.split_whitespace().collect();
                    let [from_stage, src, dst] = words[..] else {
                        panic!("COPY with other than --from=STAGE SRC DST: {line}");
                    };
                    assert_eq!(from_stage, "--from=build", "{line}");
                    let src = src
                        .strip_prefix("/src/target/")
                        .unwrap_or_else(|| panic!("COPY of other than /src/target/: {line}"));
                    stage.copies.push((src.into(), dst.into()));
                }
                "ENTRYPOINT" => {
                    stage.entrypoint = rest
                        .trim_start_matches('[')
                        .trim_end_matches(']')
                        .split(',')
                        .map(|w| w.trim().trim_matches('"').to_string())
                        .collect()
                }
                "USER" => stage.user = rest.into(),
                "ENV" => {
                    let (k, v) = rest.split_once('=').expect("ENV KEY=value");
                    stage.env.push((k.into(), v.into()));
                }
                _ => {}
            }
        }
        stage
    }

    #[test]
    fn the_dockerfile_builds_the_same_image() {
        let dockerfile = std::fs::read_to_string(crate::root().join("deploy/Dockerfile"))
            .expect("deploy/Dockerfile");
        let stage = last_stage(&dockerfile);
        let want = Stage {
            copies: CONTENT
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
            entrypoint: ENTRYPOINT.iter().map(|s| s.to_string()).collect(),
            user: USER.into(),
            env: ENV
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        assert_eq!(
            stage, want,
            "deploy/Dockerfile and xtask/src/image/capstan.rs"
        );
        // It compiles the plugins where the image has them, and is named the same.
        let precompile = format!("capstan precompile target/plugins target/{}", "compiled");
        assert!(
            dockerfile.contains(&precompile),
            "the Dockerfile runs `{precompile}`"
        );
        assert!(
            dockerfile.contains(&format!("-t {} ", name())),
            "the Dockerfile's build command tags {}",
            name()
        );
    }

    #[test]
    fn the_deployment_runs_this_image() {
        for file in ["deploy/base/deployment.yaml"] {
            let text = std::fs::read_to_string(crate::root().join(file)).unwrap();
            let images: Vec<&str> = text
                .lines()
                .filter_map(|l| l.trim().strip_prefix("image: "))
                .collect();
            assert!(!images.is_empty(), "{file} names no image");
            for image in images {
                assert_eq!(image, name(), "{file}");
            }
        }
    }

    #[test]
    fn a_dockerfile_that_differs_is_caught() {
        let dockerfile = std::fs::read_to_string(crate::root().join("deploy/Dockerfile")).unwrap();
        let other = dockerfile.replace("USER 65532:65532", "USER 1000:1000");
        assert_ne!(last_stage(&other), last_stage(&dockerfile));
        let other = dockerfile.replace("/opt/capstan/plugins/", "/plugins/");
        assert_ne!(last_stage(&other), last_stage(&dockerfile));
    }
}
