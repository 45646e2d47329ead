//! `cargo xtask bench`: the benchmarks of docs/performance.md. Builds release binaries,
//! measures the sandbox (`host/examples/sandbox_bench.rs`), starts a local control plane
//! of its own, runs the cluster benchmarks (`tests/bench`, driver `capstan-bench`) on
//! it and stops it again, also on failure or Ctrl-C. Results: tables on stdout, JSON in
//! `target/bench/`.
//!
//! The Widget scenario also reads the API server's own `apiserver_request_total`
//! before and after each size: API requests per converged parent, by verb (goal for
//! 1000 parents: at most 3.1, two children and one status being 3).
//!
//! `--quick` runs every scenario at small sizes with the debug binaries, in seconds;
//! `cargo xtask test` runs it against its own cluster ([`quick`]), checking only that
//! each scenario converges.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{
    BuiltPlugins, TestPlugins, build_host, build_plugins, build_release, cluster, run_cmd,
    target_dir,
};

const USAGE: &str = "usage: cargo xtask bench [--quick] [-- DRIVER-ARGS…]

  --quick   small sizes, debug binaries, one trial: every scenario in seconds
  DRIVER-ARGS are passed to capstan-bench, e.g. `-- --only uuid,widget`
";

/// Entry point of `cargo xtask bench`.
pub fn main(args: &[String]) -> Result<()> {
    let (ours, driver_args) = match args.iter().position(|a| a == "--") {
        Some(i) => (&args[..i], &args[i + 1..]),
        None => (args, &[][..]),
    };
    let quick = match ours {
        [] => false,
        [flag] if flag == "--quick" => true,
        _ => bail!("{USAGE}"),
    };
    // Ctrl-C reaches the driver and capstan (same process group); the xtask stays to
    // stop the cluster.
    ctrlc::set_handler(|| eprintln!("bench: interrupted; stopping"))
        .context("install Ctrl-C handler")?;
    let built = build_plugins(TestPlugins::Shipped)?;
    let bins = if quick {
        Binaries::debug()?
    } else {
        Binaries::release()?
    };
    let out = out_dir(quick);
    run_cmd(&mut bins.sandbox(&built, &out, quick))?;
    let state_dir = target_dir().join("bench-cluster");
    // kwok's nodes only: the benchmarks' hundreds of Pods must not run for real.
    let options = cluster::UpOptions::default()
        .state_dir(&state_dir)
        .node(cluster::NodeChoice::Kwok);
    let cluster = cluster::up(&options)?;
    let result = run_cmd(bins.driver(&cluster, &built, &out, quick).args(driver_args));
    let stopped = cluster::down(&cluster.state_dir);
    result?;
    stopped?;
    println!("bench: results in {}", out.display());
    Ok(())
}

/// The quick benchmark, once, against `cluster` (for `cargo xtask test`, after its
/// tests): the debug binaries it built, every scenario at small sizes.
pub fn quick(cluster: &cluster::Cluster, built: &BuiltPlugins) -> Result<()> {
    let bins = Binaries::debug()?;
    let out = out_dir(true);
    run_cmd(&mut bins.sandbox(built, &out, true))?;
    run_cmd(&mut bins.driver(cluster, built, &out, true))
}

fn out_dir(quick: bool) -> PathBuf {
    match quick {
        true => target_dir().join("bench/quick"),
        false => target_dir().join("bench"),
    }
}

/// Each shipped plugin's recorded call cost over the reference guest's, by profile.
const CALL_RATIOS: &str = "host/examples/call-ratios.json";

/// The binaries a benchmark runs.
struct Binaries {
    capstan: PathBuf,
    driver: PathBuf,
    native: PathBuf,
    sandbox_bench: PathBuf,
}

impl Binaries {
    fn in_dir(dir: &Path) -> Self {
        Binaries {
            capstan: dir.join("capstan"),
            driver: dir.join("capstan-bench"),
            native: dir.join("native-uuid"),
            sandbox_bench: dir.join("examples/sandbox_bench"),
        }
    }

    /// The release build: what the figures are about.
    fn release() -> Result<Self> {
        Ok(Self::in_dir(&build_release()?))
    }

    /// The debug build `cargo xtask test` makes anyway (`cargo test --no-run` builds
    /// binaries and examples too); built here if missing.
    fn debug() -> Result<Self> {
        let bins = Self::in_dir(&target_dir().join("debug"));
        if ![
            &bins.capstan,
            &bins.driver,
            &bins.native,
            &bins.sandbox_bench,
        ]
        .iter()
        .all(|p| p.exists())
        {
            build_host()?;
        }
        Ok(bins)
    }

    /// The sandbox benchmark, with the guard of each plugin's call cost against the
    /// reference guest (the test plugin `pass`): the ratios recorded in
    /// [`CALL_RATIOS`] for this build's profile (debug for `--quick`, release otherwise)
    /// fail the run when one grows by more than the file's limit.
    fn sandbox(&self, built: &BuiltPlugins, out: &Path, quick: bool) -> Command {
        let mut cmd = Command::new(&self.sandbox_bench);
        cmd.arg(&built.plugins)
            .args(["--calls", if quick { "200" } else { "2000" }])
            .arg("--json")
            .arg(out.join("sandbox.json"))
            .arg("--reference")
            .arg(built.test_plugins.join("pass.wasm"))
            .arg("--guard")
            .arg(crate::root().join(CALL_RATIOS));
        cmd
    }

    fn driver(
        &self,
        cluster: &cluster::Cluster,
        built: &BuiltPlugins,
        out: &Path,
        quick: bool,
    ) -> Command {
        let mut cmd = Command::new(&self.driver);
        cmd.arg("--capstan")
            .arg(&self.capstan)
            .arg("--native")
            .arg(&self.native)
            .arg("--plugins")
            .arg(&built.plugins)
            .arg("--test-plugins")
            .arg(&built.test_plugins)
            .arg("--out")
            .arg(out)
            .env("KUBECONFIG", &cluster.kubeconfig);
        if quick {
            cmd.arg("--quick");
        }
        cmd
    }
}
