//! Build automation for Capstan, reached as `cargo xtask <command>`.
//!
//! Only the standard library, `anyhow`, `ctrlc` and, for images, `tar`, `flate2` and
//! `sha2`: the xtask must compile in seconds on a fresh machine, before anything else is
//! built.

mod bench;
mod cluster;
mod demo;
mod fixtures;
mod image;
mod js;
mod oci;
mod python;
mod sdks;
mod tools;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

const USAGE: &str = "usage: cargo xtask <command>

commands:
  demo [--once]            build everything, start a local cluster, run capstan with the
                           shipped plugins and show them at work (--once: exit after showing)
  test                     every test: unit, render, control plane, end to end, and
                           clippy (-D warnings) beside them
  plugins [--shipped]      build the plugins (wasm32-wasip2) into target/plugins/ and the
                           test plugins into target/test-plugins/ (--shipped: only the
                           former, which needs no Node.js)
  bench [--quick]          benchmarks on a local cluster: Capstan against a native
                           controller, scaling, memory, hot reload, restart, the sandbox
                           (docs/performance.md; results in target/bench/)
  sdks                     the Rust, Python and TypeScript SDKs packaged as their
                           registries take them, into target/sdks/ (for `capstan new --sdks`)
  cluster up|down|status   a real local Kubernetes control plane (built from Go modules)
  image [capstan|postgres] [--import]
                           container images without Docker (OCI tars in target/images/):
                           capstan with the shipped plugins, and postgres for the
                           PostgreSQL plugin; --import: into the local cluster's node
";

/// Shipped plugins: (package, file name under target/plugins/).
const PLUGINS: &[(&str, &str)] = &[
    ("capstan-plugin-uuid", "uuid.wasm"),
    ("capstan-plugin-postgresql", "postgresql.wasm"),
];
/// Plugins used only by tests, built into target/test-plugins/.
const TEST_PLUGINS: &[(&str, &str)] = &[
    ("capstan-test-widget", "widget.wasm"),
    ("capstan-test-guard", "guard.wasm"),
    ("capstan-test-stall", "stall.wasm"),
    ("capstan-test-fickle", "fickle.wasm"),
    ("capstan-test-mirror", "mirror.wasm"),
    ("capstan-test-ticket", "ticket.wasm"),
    ("capstan-test-pass", "pass.wasm"),
    ("capstan-test-lease-guard", "lease-guard.wasm"),
];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(err) = run(&args) {
        eprintln!("xtask: {err:#}");
        std::process::exit(1);
    }
}

fn run(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("cluster") => cluster::main(&args[1..]),
        Some("plugins") => match &args[1..] {
            [] => build_plugins(TestPlugins::Fixtures).map(drop),
            [flag] if flag == "--shipped" => build_plugins(TestPlugins::None).map(drop),
            _ => bail!("usage: cargo xtask plugins [--shipped]"),
        },
        Some("test") => test(&args[1..]),
        Some("sdks") => sdks::build().map(drop),
        Some("demo") => demo::main(&args[1..]),
        Some("bench") => bench::main(&args[1..]),
        Some("image") => image::main(&args[1..]),
        Some("-h" | "--help") | None => {
            print!("{USAGE}");
            Ok(())
        }
        Some(other) => bail!("unknown command `{other}`\n\n{USAGE}"),
    }
}

/// The workspace root (the parent of xtask/).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// The shared target directory.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// Runs a command in the workspace root, failing with its name if it fails.
pub fn run_cmd(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let status = cmd
        .current_dir(root())
        .status()
        .with_context(|| format!("cannot start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed ({status})");
    }
    Ok(())
}

/// `cargo`, as the one running the xtask.
pub fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// Paths of the built plugins.
pub struct BuiltPlugins {
    /// target/plugins: the shipped plugins.
    pub plugins: PathBuf,
    /// target/test-plugins: plugins only tests use.
    pub test_plugins: PathBuf,
}

/// Whether and how the plugins only tests and benchmarks use are built.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum TestPlugins {
    /// Not built: the shipped plugins only (the demo, `cargo xtask plugins --shipped`).
    None,
    /// As test fixtures (`fixtures::fixture_build`): lightly optimized, in the fixtures'
    /// own target directory, beside the other fixtures. Tests check what a plugin does,
    /// not how small or fast it is.
    Fixtures,
    /// With the shipped plugins' profile: the benchmarks measure the Widget plugin.
    Shipped,
}

/// Builds every plugin (Rust, Python, TypeScript) and copies them to stable names.
pub fn build_plugins(tests: TestPlugins) -> Result<BuiltPlugins> {
    tools::ensure_wasm_targets()?;
    let built = BuiltPlugins {
        plugins: target_dir().join("plugins"),
        test_plugins: target_dir().join("test-plugins"),
    };
    let mut cmd = cargo();
    cmd.args(["build", "--profile", "plugin", "--target", "wasm32-wasip2"]);
    let with_shipped = match tests {
        TestPlugins::Shipped => TEST_PLUGINS,
        TestPlugins::None | TestPlugins::Fixtures => &[],
    };
    for (package, _) in PLUGINS.iter().chain(with_shipped) {
        cmd.args(["--package", package]);
    }
    run_cmd(&mut cmd)?;
    let out = target_dir().join("wasm32-wasip2/plugin");
    copy_built(&out, PLUGINS, &built.plugins)?;
    copy_built(&out, with_shipped, &built.test_plugins)?;
    if tests != TestPlugins::None {
        std::fs::create_dir_all(&built.test_plugins)?;
        if tests == TestPlugins::Fixtures {
            fixtures::build_test_plugins(TEST_PLUGINS, &built.test_plugins)?;
        }
        // The shipped plugins as built for contract 0.1.0, which the host still runs.
        fixtures::build_contract_0_1(&built.test_plugins)?;
        // The PostgreSQL plugin with its images from a mirror (`capstan plan`'s tests).
        fixtures::build_postgres_mirror(&built.test_plugins)?;
        // The Widget plugin broken on every parent (the canary's tests), and rebuilt
        // healthy in other bytes (a moved tag promoted, in the registry's tests).
        fixtures::build_widget_broken(&built.test_plugins)?;
        fixtures::build_widget_rebuilt(&built.test_plugins)?;
    }
    python::build_plugins(&built.plugins)?;
    if tests != TestPlugins::None {
        // The TypeScript example is a starting point to copy, not a shipped plugin.
        js::build_plugins(&built.test_plugins)?;
    }
    println!("plugins: {}", built.plugins.display());
    Ok(built)
}

/// Copies the built `packages` (package, file name) from cargo's output directory `from`
/// to their stable names in `to`.
pub fn copy_built(from: &Path, packages: &[(&str, &str)], to: &Path) -> Result<()> {
    if packages.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(to)?;
    for (package, file) in packages {
        let built = from.join(format!("{}.wasm", package.replace('-', "_")));
        std::fs::copy(&built, to.join(file))
            .with_context(|| format!("copy {}", built.display()))?;
    }
    Ok(())
}

/// Builds the `capstan` binary together with every test, through `cargo test --no-run`:
/// one feature resolution for the demo and the tests, so wasmtime and kube are compiled
/// once per machine rather than once per command.
pub fn build_host() -> Result<PathBuf> {
    run_cmd(cargo().args(["test", "--workspace", "--no-run"]))?;
    Ok(target_dir().join("debug/capstan"))
}

/// Builds the release binaries, `capstan` with what `cargo xtask bench` runs beside it,
/// in one command: the image and the benchmarks then share one build (one feature
/// resolution) instead of compiling wasmtime twice. Returns the release directory.
pub fn build_release() -> Result<PathBuf> {
    run_cmd(cargo().args([
        "build",
        "--release",
        "--package",
        "capstan",
        "--package",
        "capstan-bench",
        "--bins",
        "--example",
        "sandbox_bench",
    ]))?;
    Ok(target_dir().join("release"))
}

/// `cargo xtask test`: builds what the tests need, starts a local control plane, runs
/// every test with it, and stops it again, also when tests fail.
fn test(args: &[String]) -> Result<()> {
    let options = cluster::UpOptions::for_tests();
    // What is not Rust (the Go builds of the control plane, the node and helm, and the
    // postgres images: downloads from the module proxy, Debian and PyPI, then `go
    // build`) goes on a thread beside the Rust builds, and is joined before the cluster
    // starts, also when a Rust step fails (no `go build` outlives the command).
    let state_dir = options.state_dir.clone();
    let beside = std::thread::spawn(move || -> Result<()> {
        if cluster::prebuild(&state_dir)? {
            image::prebuild_postgres()?;
        }
        Ok(())
    });
    let rust = (|| -> Result<_> {
        let built = build_plugins(TestPlugins::Fixtures)?;
        python::unit_tests()?;
        js::test()?;
        let component_plugin = tools::build_with_cargo_component()?;
        let sdks = sdks::build()?;
        build_host()?;
        Ok((built, component_plugin, sdks))
    })();
    let beside = beside
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("the thread of the Go builds panicked")));
    let (built, component_plugin, sdks) = rust?;
    beside.context("build the cluster's binaries and images")?;
    let helm = cluster::ensure_helm()?;
    let crane = cluster::ensure_crane()?;
    // `down` must leave the machine as `up` found it (no mount, cgroup, veth, process,
    // iptables rule or sysctl of the real node): checked after every test run.
    let host_before = cluster::HostSnapshot::take(&options.state_dir)?;
    let cluster = cluster::up(&options)?;
    // The images the real node's tests run (capstan:0.1.0, postgres:16.14 and 16.15).
    // Without a real node those tests fail, saying so; the others run on kwok. The
    // capstan image holds the test build of the host, not a second, release build.
    let imported = match cluster.real_node {
        true => image::build_and_import(&cluster.state_dir, Some(image::capstan::Host::Test)),
        false => Ok(()),
    };
    if let Err(err) = imported {
        let _ = cluster::down(&cluster.state_dir);
        return Err(err.context("build the images for the real node"));
    }
    // The lints beside the tests: clippy only checks, the tests mostly wait on the
    // cluster, and cargo does not hold the target directory while tests run.
    let lints = std::thread::spawn(|| {
        run_cmd(cargo().args([
            "clippy",
            "--quiet",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))
    });
    let result = run_cmd(
        cargo()
            .args(["test", "--workspace", "--no-fail-fast"])
            .args(args)
            .env("KUBECONFIG", &cluster.kubeconfig)
            .env("CAPSTAN_PLUGIN_DIR", &built.plugins)
            .env("CAPSTAN_TEST_PLUGIN_DIR", &built.test_plugins)
            .env("CAPSTAN_COMPONENT_PLUGIN", &component_plugin)
            // The SDK packages `capstan new --sdks` takes (host/tests/new.rs).
            .env("CAPSTAN_SDKS", &sdks)
            // The fake-tier churn at the size (`cargo test -p capstan` alone
            // churns 300 parents, to stay within seconds).
            .env("CAPSTAN_CHURN_PARENTS", "10000")
            .env("CAPSTAN_BIN", target_dir().join("debug/capstan"))
            .env("CAPSTAN_KUBECTL", cluster.bin_dir.join("kubectl"))
            // The Helm chart's tests (tests/e2e/tests/helm.rs).
            .env("CAPSTAN_HELM", &helm)
            // The OCI registry of the plugin pull and push tests (`crane registry serve`).
            .env("CAPSTAN_CRANE", &crane)
            // What the fault tests need to restart components and read the audit log.
            .env("CAPSTAN_CLUSTER_DIR", &cluster.state_dir)
            .env("CAPSTAN_XTASK", std::env::current_exe()?),
    );
    // Every benchmark path at small sizes: that each converges is checked, times are not.
    let benched = bench::quick(&cluster, &built);
    let stopped = cluster::down(&cluster.state_dir);
    let lints = lints
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("the thread of clippy panicked")));
    result?;
    benched?;
    stopped?;
    lints.context("clippy -D warnings")?;
    let left = cluster::HostSnapshot::take(&cluster.state_dir)?.changes_since(&host_before);
    if !left.is_empty() {
        bail!(
            "`cluster down` left the machine changed:\n{}",
            left.join("\n")
        );
    }
    Ok(())
}
