//! The pinned Go builds of the control plane's binaries (and of `helm`, for the chart in
//! deploy/helm/), and the cache they live in.
//!
//! `tests/control-plane/` holds one wrapper Go module per upstream project (kubernetes,
//! etcd, kwok, helm) so that their dependency graphs never move each other, plus `pki`, a
//! standard-library-only credential maker. The binaries are built from those modules
//! with `go build` into a cache directory outside the repository, keyed by the pinned
//! versions; a build that finds them there does nothing.
//!
//! The real node's binaries (runc, containerd, the CNI plugins, kubelet, kube-proxy,
//! CoreDNS, the pause program, the volume provisioner and the API server relay) live in a
//! second cache directory with its own key, so that a change of one of their versions
//! never rebuilds the control plane.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context, Result, bail};

/// `k8s.io/kubernetes` release whose apiserver, controller-manager, scheduler and kubectl
/// are built; k8s-openapi's `v1_37` feature matches it.
pub const KUBERNETES_VERSION: &str = "v1.37.2";
/// `go.etcd.io/etcd/server/v3` release.
pub const ETCD_VERSION: &str = "v3.6.16";
/// `sigs.k8s.io/kwok` release: the fake kubelets.
pub const KWOK_VERSION: &str = "v0.8.0";
/// `github.com/opencontainers/runc` release (built with seccomp: containerd gives every
/// sandbox a seccomp profile, which a runc without it refuses).
pub const RUNC_VERSION: &str = "v1.5.3";
/// `github.com/containerd/containerd/v2` release: containerd, its runc shim and `ctr`.
pub const CONTAINERD_VERSION: &str = "v2.4.2";
/// `github.com/containernetworking/plugins` release.
pub const CNI_PLUGINS_VERSION: &str = "v1.10.0";
/// `github.com/coredns/coredns` release, built with the plugins `coredns/main.go` names.
pub const COREDNS_VERSION: &str = "v1.15.0";
/// `sigs.k8s.io/sig-storage-lib-external-provisioner` release under `capstan-provisioner`.
pub const PROVISIONER_LIB_VERSION: &str = "v13.1.0";
/// `helm.sh/helm/v4` release: renders, lints and installs deploy/helm/capstan.
pub const HELM_VERSION: &str = "v4.3.2";
/// `github.com/google/go-containerregistry` release: `crane registry serve`, the OCI
/// registry the tests of `capstan push` and `--plugin oci://` pull from.
pub const CRANE_VERSION: &str = "v0.22.1";

/// One binary of the control plane and where it is built from.
struct Binary {
    /// File name in the bin directory.
    name: &'static str,
    /// Wrapper module directory under `tests/control-plane/`.
    module: &'static str,
    /// Go package with the `main` function.
    package: &'static str,
    /// Built with cgo and these build tags (runc's seccomp); otherwise static, no cgo.
    cgo_tags: Option<&'static str>,
}

impl Binary {
    const fn go(name: &'static str, module: &'static str, package: &'static str) -> Self {
        Self {
            name,
            module,
            package,
            cgo_tags: None,
        }
    }
}

const BINARIES: &[Binary] = &[
    Binary::go("etcd", "etcd", "go.etcd.io/etcd/server/v3"),
    Binary::go(
        "kube-apiserver",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kube-apiserver",
    ),
    Binary::go(
        "kube-controller-manager",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
    ),
    Binary::go(
        "kube-scheduler",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kube-scheduler",
    ),
    Binary::go("kubectl", "kubernetes", "k8s.io/kubernetes/cmd/kubectl"),
    Binary::go("kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok"),
    Binary::go("capstan-pki", "pki", "."),
];

/// The real node's Go binaries; the pause program is compiled from C ([`PAUSE`]).
const NODE_BINARIES: &[Binary] = &[
    Binary {
        name: "runc",
        module: "runc",
        package: "github.com/opencontainers/runc",
        cgo_tags: Some("seccomp"),
    },
    Binary::go(
        "containerd",
        "containerd",
        "github.com/containerd/containerd/v2/cmd/containerd",
    ),
    Binary::go(
        "containerd-shim-runc-v2",
        "containerd",
        "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
    ),
    Binary::go(
        "ctr",
        "containerd",
        "github.com/containerd/containerd/v2/cmd/ctr",
    ),
    Binary::go(
        "bridge",
        "cni-plugins",
        "github.com/containernetworking/plugins/plugins/main/bridge",
    ),
    Binary::go(
        "loopback",
        "cni-plugins",
        "github.com/containernetworking/plugins/plugins/main/loopback",
    ),
    Binary::go(
        "host-local",
        "cni-plugins",
        "github.com/containernetworking/plugins/plugins/ipam/host-local",
    ),
    Binary::go(
        "portmap",
        "cni-plugins",
        "github.com/containernetworking/plugins/plugins/meta/portmap",
    ),
    Binary::go("kubelet", "kubernetes", "k8s.io/kubernetes/cmd/kubelet"),
    Binary::go(
        "kube-proxy",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kube-proxy",
    ),
    Binary::go("coredns", "coredns", "."),
    Binary::go("capstan-provisioner", "provisioner", "."),
    Binary::go("capstan-relay", "relay", "."),
    Binary::go("probe", "probe", "."),
];

/// `helm`, for the chart in deploy/helm/: a key of its own, so that a new helm never
/// rebuilds the control plane.
const HELM_BINARIES: &[Binary] = &[Binary::go("helm", "helm", "helm.sh/helm/v4/cmd/helm")];
const CRANE_BINARIES: &[Binary] = &[Binary::go(
    "crane",
    "crane",
    "github.com/google/go-containerregistry/cmd/crane",
)];

/// The pause program (every pod's sandbox process), in the node's bin directory.
pub const PAUSE: &str = "pause";

/// The upstream module each wrapper module pins, as `go.mod` must spell it.
const PINS: &[(&str, &str, &str)] = &[
    ("kubernetes", "k8s.io/kubernetes", KUBERNETES_VERSION),
    ("etcd", "go.etcd.io/etcd/server/v3", ETCD_VERSION),
    ("kwok", "sigs.k8s.io/kwok", KWOK_VERSION),
    ("runc", "github.com/opencontainers/runc", RUNC_VERSION),
    (
        "containerd",
        "github.com/containerd/containerd/v2",
        CONTAINERD_VERSION,
    ),
    (
        "cni-plugins",
        "github.com/containernetworking/plugins",
        CNI_PLUGINS_VERSION,
    ),
    ("coredns", "github.com/coredns/coredns", COREDNS_VERSION),
    (
        "provisioner",
        "sigs.k8s.io/sig-storage-lib-external-provisioner/v13",
        PROVISIONER_LIB_VERSION,
    ),
    ("helm", "helm.sh/helm/v4", HELM_VERSION),
    (
        "crane",
        "github.com/google/go-containerregistry",
        CRANE_VERSION,
    ),
];

/// The Go modules and manifests that pin the control plane, in the repository.
pub fn control_plane_dir() -> PathBuf {
    let xtask = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask.parent().unwrap_or(xtask).join("tests/control-plane")
}

/// `$CAPSTAN_CACHE_DIR`, else `$XDG_CACHE_HOME/capstan`, else `~/.cache/capstan`.
pub fn cache_dir() -> Result<PathBuf> {
    capstan_toolchain::cache_dir()
}

/// Where the binaries of the pinned versions live (they may not be built yet).
pub fn bin_dir() -> Result<PathBuf> {
    let key = format!("k8s-{KUBERNETES_VERSION}-etcd-{ETCD_VERSION}-kwok-{KWOK_VERSION}");
    Ok(cache_dir()?.join(key).join("bin"))
}

/// Where `helm` of the pinned version lives (maybe not built yet).
pub fn helm_bin_dir() -> Result<PathBuf> {
    Ok(cache_dir()?
        .join(format!("helm-{HELM_VERSION}"))
        .join("bin"))
}

/// Builds `helm` if it is missing from the cache and returns its path.
pub fn ensure_helm() -> Result<PathBuf> {
    let bin = helm_bin_dir()?;
    ensure(HELM_BINARIES, &bin, "helm (about 5 minutes on 2 busy cores")?;
    Ok(bin.join("helm"))
}

/// Where `crane` of the pinned version lives (maybe not built yet).
pub fn crane_bin_dir() -> Result<PathBuf> {
    Ok(cache_dir()?
        .join(format!("crane-{CRANE_VERSION}"))
        .join("bin"))
}

/// Builds `crane` if it is missing from the cache and returns its path.
pub fn ensure_crane() -> Result<PathBuf> {
    let bin = crane_bin_dir()?;
    ensure(
        CRANE_BINARIES,
        &bin,
        "crane (about 1 minute on 2 busy cores",
    )?;
    Ok(bin.join("crane"))
}

/// Where the real node's binaries of the pinned versions live (maybe not built yet).
pub fn node_bin_dir() -> Result<PathBuf> {
    let key = format!(
        "node-k8s-{KUBERNETES_VERSION}-containerd-{CONTAINERD_VERSION}-runc-{RUNC_VERSION}-\
         cni-{CNI_PLUGINS_VERSION}-coredns-{COREDNS_VERSION}"
    );
    Ok(cache_dir()?.join(key).join("bin"))
}

/// Builds whichever control-plane binaries are missing from the cache and returns the
/// bin directory holding all of them.
///
/// Needs `go` (1.26 or newer) on `PATH` and the Go module proxy the first time; after
/// that it only looks at the files. Each binary appears atomically, so an interrupted
/// build leaves nothing half-written behind.
pub fn ensure_binaries() -> Result<PathBuf> {
    let bin = bin_dir()?;
    ensure(
        BINARIES,
        &bin,
        "the control plane (from cold, about 12 minutes on 2 cores",
    )?;
    Ok(bin)
}

/// Builds whichever of the real node's binaries are missing (see [`ensure_binaries`]),
/// the pause program among them, and returns their bin directory. Installs Debian's
/// `libseccomp-dev` first if runc needs building and its header is missing.
pub fn ensure_node_binaries() -> Result<PathBuf> {
    let bin = node_bin_dir()?;
    if needs_build(&NODE_BINARIES[0], &bin) {
        ensure_debian_package("/usr/include/seccomp.h", "libseccomp-dev")?;
    }
    ensure(
        NODE_BINARIES,
        &bin,
        "the node (about 10 minutes on 2 busy cores after the control plane's build",
    )?;
    if !bin.join(PAUSE).is_file() {
        build_pause(&bin)?;
    }
    Ok(bin)
}

fn ensure(binaries: &[Binary], bin: &Path, cold: &str) -> Result<()> {
    let missing: Vec<&Binary> = binaries.iter().filter(|b| needs_build(b, bin)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    check_go()?;
    check_pins(&missing)?;
    fs::create_dir_all(bin).with_context(|| format!("create {}", bin.display()))?;
    // Only the Kubernetes binaries need the version stamp (and the module lookup for it).
    let ldflags = match missing.iter().any(|b| b.module == "kubernetes") {
        true => kubernetes_ldflags()?,
        false => "-s -w".to_owned(),
    };
    if missing.iter().any(|b| b.package != ".") {
        eprintln!(
            "cluster: building {cold}; then never again for these versions) into {} …",
            bin.display()
        );
    }
    let started = Instant::now();
    for binary in missing {
        match binary.module {
            "helm" => build(binary, bin, &helm_ldflags())?,
            _ => build(binary, bin, &ldflags)?,
        }
    }
    eprintln!(
        "cluster: binaries built in {:.0?} into {}",
        started.elapsed(),
        bin.display()
    );
    Ok(())
}

/// Installs a Debian package with `apt-get` unless `file` (which it provides) exists:
/// the node's build and run time needs are met once per machine, by `cluster build` or
/// `cluster up`, not by a setup guide.
pub fn ensure_debian_package(file: &str, package: &str) -> Result<()> {
    if Path::new(file).exists() {
        return Ok(());
    }
    eprintln!("cluster: {file} is missing; installing Debian's {package} (apt-get) …");
    let install = |args: &[&str]| {
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(Stdio::null())
            .status()
    };
    let mut status = install(&["install", "-y", "-q", "--no-install-recommends", package]);
    if !status.as_ref().is_ok_and(|s| s.success()) {
        // A fresh machine may have no package lists yet.
        let _ = install(&["update", "-q"]);
        status = install(&["install", "-y", "-q", "--no-install-recommends", package]);
    }
    match status {
        Ok(s) if s.success() && Path::new(file).exists() => Ok(()),
        Ok(s) => bail!("`apt-get install {package}` failed ({s}); install it by hand"),
        Err(err) => bail!("cannot run apt-get to install {package} ({err}); install it by hand"),
    }
}

/// `gcc -static` of the pause program in the pinned Kubernetes source (the module cache
/// has it), as its release images do.
fn build_pause(bin: &Path) -> Result<()> {
    let source = module_info(
        &control_plane_dir().join("kubernetes"),
        &format!("k8s.io/kubernetes@{KUBERNETES_VERSION}"),
        "Dir",
    )?;
    let source = Path::new(&source).join("build/pause/linux/pause.c");
    let partial = bin.join(format!("{PAUSE}.partial-{}", std::process::id()));
    eprintln!("cluster: gcc -static {} → {PAUSE}", source.display());
    let output = Command::new("gcc")
        .args(["-Os", "-Wall", "-Werror", "-static"])
        .arg(format!("-DVERSION={KUBERNETES_VERSION}"))
        .arg("-o")
        .arg(&partial)
        .arg(&source)
        .output()
        .context("run gcc (the pause program is C; install gcc)")?;
    if !output.status.success() {
        let _ = fs::remove_file(&partial);
        bail!(
            "gcc {} failed: {}",
            source.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    fs::rename(&partial, bin.join(PAUSE)).context("move the pause program into place")
}

/// Missing, or built from this repository's own source (`package: "."`, not covered by the
/// version key) and older than that source.
fn needs_build(binary: &Binary, bin: &Path) -> bool {
    let built = match fs::metadata(bin.join(binary.name)).and_then(|m| m.modified()) {
        Ok(built) => built,
        Err(_) => return true,
    };
    if binary.package != "." {
        return false;
    }
    let sources = fs::read_dir(control_plane_dir().join(binary.module))
        .into_iter()
        .flatten();
    sources.flatten().any(|entry| {
        let newer = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|m| m > built);
        newer && entry.file_name().to_string_lossy().ends_with(".go")
    })
}

fn build(binary: &Binary, bin: &Path, ldflags: &str) -> Result<()> {
    eprintln!("cluster: go build {} → {}", binary.package, binary.name);
    let partial = bin.join(format!("{}.partial-{}", binary.name, std::process::id()));
    let mut go = Command::new("go");
    go.current_dir(control_plane_dir().join(binary.module));
    match binary.cgo_tags {
        Some(tags) => go
            .env("CGO_ENABLED", "1")
            .arg("build")
            .arg(format!("-tags={tags}")),
        // Static binaries, the same as Kubernetes' own releases, and no C toolchain needed.
        None => go.env("CGO_ENABLED", "0").arg("build"),
    };
    let status = go
        .args(["-trimpath", "-buildvcs=false"])
        .arg(format!("-ldflags={ldflags}"))
        .arg("-o")
        .arg(&partial)
        .arg(binary.package)
        .status()
        .context("run `go build`")?;
    if !status.success() {
        let _ = fs::remove_file(&partial);
        bail!(
            "`go build {}` failed ({status}); its output is above",
            binary.package
        );
    }
    fs::rename(&partial, bin.join(binary.name))
        .with_context(|| format!("move {} into place", partial.display()))
}

/// Strips the binaries and stamps the Kubernetes version that `/version` and
/// `kubectl version` report (harmless for the binaries that lack these variables).
fn kubernetes_ldflags() -> Result<String> {
    let (major, minor) = major_minor(KUBERNETES_VERSION)?;
    // The time the module proxy has for the tag: the same on every machine.
    let build_date = go_output(
        &control_plane_dir().join("kubernetes"),
        &[
            "list",
            "-m",
            "-f",
            "{{.Time.UTC.Format \"2006-01-02T15:04:05Z\"}}",
            "k8s.io/kubernetes",
        ],
    )?;
    let mut flags = String::from("-s -w");
    for package in [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ] {
        for (var, value) in [
            ("gitMajor", major),
            ("gitMinor", minor),
            ("gitVersion", KUBERNETES_VERSION),
            // The module proxy does not say which commit the tag is; better empty than
            // the "$Format:%H$" placeholder the source carries.
            ("gitCommit", ""),
            ("gitTreeState", "clean"),
            ("buildDate", build_date.trim()),
        ] {
            flags.push_str(&format!(" -X {package}.{var}={value}"));
        }
    }
    Ok(flags)
}

/// Strips helm and stamps the version `helm version` reports (its source says "v4.3").
fn helm_ldflags() -> String {
    let package = "helm.sh/helm/v4/internal/version";
    format!("-s -w -X {package}.version={HELM_VERSION} -X {package}.gitTreeState=clean")
}

fn major_minor(version: &str) -> Result<(&str, &str)> {
    let mut parts = version.trim_start_matches('v').split('.');
    match (parts.next(), parts.next()) {
        (Some(major), Some(minor)) => Ok((major, minor)),
        _ => bail!("version {version} is not vMAJOR.MINOR.PATCH"),
    }
}

fn check_go() -> Result<()> {
    match Command::new("go")
        .arg("version")
        .stdout(Stdio::null())
        .status()
    {
        Ok(status) if status.success() => Ok(()),
        _ => bail!(
            "the control plane is built from Go modules, but `go` (1.26 or newer) is not on PATH"
        ),
    }
}

/// Refuses to build from wrapper modules that pin other versions than this file says.
fn check_pins(building: &[&Binary]) -> Result<()> {
    let pins = PINS
        .iter()
        .filter(|(module, ..)| building.iter().any(|b| b.module == *module));
    for (module, path, version) in pins {
        let go_mod = control_plane_dir().join(module).join("go.mod");
        let text =
            fs::read_to_string(&go_mod).with_context(|| format!("read {}", go_mod.display()))?;
        let pinned = text.lines().any(|line| {
            let line = line.trim().trim_start_matches("require ");
            line.split_whitespace().take(2).eq([*path, *version])
        });
        if !pinned {
            bail!(
                "{} does not pin {path} {version}; run `cargo xtask cluster pin`",
                go_mod.display()
            );
        }
    }
    Ok(())
}

/// Rewrites the wrapper modules (go.mod and go.sum) and kwok's stage file from the pinned
/// versions: `cargo xtask cluster pin`, after changing a version above.
pub fn pin() -> Result<()> {
    check_go()?;
    pin_kubernetes()?;
    pin_tool_module(
        "etcd",
        &[&format!("go.etcd.io/etcd/server/v3@{ETCD_VERSION}")],
    )?;
    pin_tool_module(
        "kwok",
        &[&format!("sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}")],
    )?;
    write_kwok_stages()?;
    pin_tool_module(
        "runc",
        &[&format!("github.com/opencontainers/runc@{RUNC_VERSION}")],
    )?;
    let containerd: Vec<String> = ["containerd", "containerd-shim-runc-v2", "ctr"]
        .iter()
        .map(|cmd| format!("github.com/containerd/containerd/v2/cmd/{cmd}@{CONTAINERD_VERSION}"))
        .collect();
    pin_tool_module(
        "containerd",
        &containerd.iter().map(String::as_str).collect::<Vec<_>>(),
    )?;
    let cni: Vec<String> = [
        "main/bridge",
        "main/loopback",
        "ipam/host-local",
        "meta/portmap",
    ]
    .iter()
    .map(|p| format!("github.com/containernetworking/plugins/plugins/{p}@{CNI_PLUGINS_VERSION}"))
    .collect();
    pin_tool_module(
        "cni-plugins",
        &cni.iter().map(String::as_str).collect::<Vec<_>>(),
    )?;
    pin_source_module(
        "coredns",
        &format!("github.com/coredns/coredns@{COREDNS_VERSION}"),
    )?;
    pin_source_module(
        "provisioner",
        &format!("sigs.k8s.io/sig-storage-lib-external-provisioner/v13@{PROVISIONER_LIB_VERSION}"),
    )?;
    pin_tool_module(
        "helm",
        &[&format!("helm.sh/helm/v4/cmd/helm@{HELM_VERSION}")],
    )?;
    pin_tool_module(
        "crane",
        &[&format!(
            "github.com/google/go-containerregistry/cmd/crane@{CRANE_VERSION}"
        )],
    )?;
    eprintln!(
        "cluster: pinned; the next `cluster up` builds into {}",
        bin_dir()?.display()
    );
    Ok(())
}

/// k8s.io/kubernetes replaces every staging module (k8s.io/api, client-go, …) with a
/// `./staging` path that a dependent cannot see; each is published as v0.MINOR.PATCH,
/// so the wrapper replaces each with that version. The list is read from the release's
/// own go.mod, never typed.
fn pin_kubernetes() -> Result<()> {
    let dir = control_plane_dir().join("kubernetes");
    let upstream = module_info(
        &dir,
        &format!("k8s.io/kubernetes@{KUBERNETES_VERSION}"),
        "GoMod",
    )?;
    let upstream = fs::read_to_string(&upstream).with_context(|| format!("read {upstream}"))?;
    let staging_version = format!("v0{}", KUBERNETES_VERSION.trim_start_matches("v1"));
    let staging = staging_modules(&upstream);
    if staging.is_empty() {
        bail!("k8s.io/kubernetes@{KUBERNETES_VERSION}'s go.mod replaces no ./staging modules");
    }
    init_module(
        &dir,
        "kubernetes",
        go_directive(&upstream).unwrap_or("1.26.0"),
    )?;
    let mut edit = vec!["mod".to_owned(), "edit".to_owned()];
    edit.extend(
        staging
            .iter()
            .map(|m| format!("-replace={m}={m}@{staging_version}")),
    );
    go(&dir, &edit.iter().map(String::as_str).collect::<Vec<_>>())?;
    let tools: Vec<String> = [
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kubectl",
        "kubelet",
        "kube-proxy",
    ]
    .iter()
    .map(|cmd| format!("k8s.io/kubernetes/cmd/{cmd}@{KUBERNETES_VERSION}"))
    .collect();
    get_tools_and_tidy(&dir, &tools.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The module paths in go.mod's `replace` directives that point into `./staging`.
fn staging_modules(go_mod: &str) -> Vec<&str> {
    go_mod
        .lines()
        .map(|line| line.trim().trim_start_matches("replace").trim())
        .filter_map(|line| line.split_once("=>"))
        .filter(|(_, target)| target.trim().starts_with("./staging/"))
        .map(|(module, _)| module.trim())
        .collect()
}

fn go_directive(go_mod: &str) -> Option<&str> {
    go_mod
        .lines()
        .find_map(|line| line.strip_prefix("go "))
        .map(str::trim)
}

fn pin_tool_module(module: &str, tools: &[&str]) -> Result<()> {
    let dir = control_plane_dir().join(module);
    init_module(&dir, module, "1.26.0")?;
    get_tools_and_tidy(&dir, tools)
}

/// A wrapper module with a `main.go` of this repository's own on top of `upstream`
/// (`module@version`). Its Kubernetes client libraries are held at the control plane's
/// patch release, so that their compiled packages come from the Go build cache.
fn pin_source_module(module: &str, upstream: &str) -> Result<()> {
    let dir = control_plane_dir().join(module);
    init_module(&dir, module, "1.26.0")?;
    let staging_version = format!("v0{}", KUBERNETES_VERSION.trim_start_matches("v1"));
    let clients: Vec<String> = ["k8s.io/api", "k8s.io/apimachinery", "k8s.io/client-go"]
        .iter()
        .map(|m| format!("{m}@{staging_version}"))
        .collect();
    let mut args = vec!["get", upstream];
    args.extend(clients.iter().map(String::as_str));
    go(&dir, &args)?;
    go(&dir, &["mod", "tidy"])
}

fn init_module(dir: &Path, name: &str, go_version: &str) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    for file in ["go.mod", "go.sum"] {
        let _ = fs::remove_file(dir.join(file));
    }
    let go_mod = format!(
        "// Generated by `cargo xtask cluster pin`; edit the versions in \
         xtask/src/cluster/binaries.rs.\nmodule capstan/control-plane/{name}\n\ngo {go_version}\n"
    );
    fs::write(dir.join("go.mod"), go_mod).with_context(|| format!("write {}/go.mod", dir.display()))
}

/// `tool` directives keep the upstream commands (and so their whole module graph) in
/// go.mod without a Go file that imports them.
fn get_tools_and_tidy(dir: &Path, tools: &[&str]) -> Result<()> {
    let mut args = vec!["get", "-tool"];
    args.extend_from_slice(tools);
    go(dir, &args)?;
    go(dir, &["mod", "tidy"])
}

/// kwok has no built-in stages; kwokctl hands it these defaults from the release's
/// `kustomize/stage` tree, and so does `cluster up` through `tests/control-plane/kwok/stages.yaml`.
fn write_kwok_stages() -> Result<()> {
    let kwok = control_plane_dir().join("kwok");
    let source = module_info(&kwok, &format!("sigs.k8s.io/kwok@{KWOK_VERSION}"), "Dir")?;
    let mut out = format!(
        "# Generated by `cargo xtask cluster pin` from sigs.k8s.io/kwok@{KWOK_VERSION}\n\
         # kustomize/stage: the stages kwokctl gives kwok by default. Do not edit.\n"
    );
    for file in [
        "node/fast/node-initialize.yaml",
        "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
        "pod/fast/pod-ready.yaml",
        "pod/fast/pod-complete.yaml",
        "pod/fast/pod-delete.yaml",
    ] {
        let path = Path::new(&source).join("kustomize/stage").join(file);
        let text = fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        out.push_str("---\n");
        out.push_str(text.trim_start_matches("---\n"));
    }
    fs::write(kwok.join("stages.yaml"), out).context("write tests/control-plane/kwok/stages.yaml")
}

/// One field of `go mod download -json MODULE@VERSION` (a file or directory in the
/// module cache).
fn module_info(dir: &Path, module: &str, field: &str) -> Result<String> {
    let json = go_output(dir, &["mod", "download", "-json", module])?;
    let key = format!("\"{field}\": \"");
    json.lines()
        .find_map(|line| line.trim().strip_prefix(&key)?.strip_suffix("\","))
        .map(str::to_owned)
        .with_context(|| format!("`go mod download -json {module}` gave no {field}"))
}

fn go(dir: &Path, args: &[&str]) -> Result<()> {
    let status = Command::new("go")
        .current_dir(dir)
        .args(args)
        .status()
        .with_context(|| format!("run `go {}`", args.join(" ")))?;
    if !status.success() {
        bail!(
            "`go {}` in {} failed ({status})",
            args.join(" "),
            dir.display()
        );
    }
    Ok(())
}

fn go_output(dir: &Path, args: &[&str]) -> Result<String> {
    let output = Command::new("go")
        .current_dir(dir)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("run `go {}`", args.join(" ")))?;
    if !output.status.success() {
        bail!(
            "`go {}` in {} failed ({})",
            args.join(" "),
            dir.display(),
            output.status
        );
    }
    String::from_utf8(output.stdout).context("go printed something that is not UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_only_staging_replacements() {
        let go_mod = "module k8s.io/kubernetes\n\ngo 1.26.0\n\nreplace (\n\
                      \tk8s.io/api => ./staging/src/k8s.io/api\n\
                      \tk8s.io/client-go => ./staging/src/k8s.io/client-go\n)\n\
                      replace example.com/x => example.com/y v1.0.0\n";
        assert_eq!(staging_modules(go_mod), ["k8s.io/api", "k8s.io/client-go"]);
        assert_eq!(go_directive(go_mod), Some("1.26.0"));
    }

    #[test]
    fn splits_major_minor() {
        assert_eq!(major_minor("v1.37.2").unwrap(), ("1", "37"));
    }
}
