//! `capstan-bench`: the driver of `cargo xtask bench`. Measures Capstan (and the native
//! Uuid controller) against the cluster of `KUBECONFIG`; prints tables, writes JSON.

use std::path::PathBuf;

use anyhow::Context as _;
use capstan_bench::scenarios::{Bench, Config};
use clap::Parser;

/// Benchmarks of `capstan run` against a real cluster.
#[derive(Debug, Parser)]
struct Args {
    /// The `capstan` binary (a release build for figures worth reading).
    #[arg(long)]
    capstan: PathBuf,
    /// The `native-uuid` binary.
    #[arg(long)]
    native: PathBuf,
    /// Directory of the shipped plugins (uuid.wasm, postgresql.wasm).
    #[arg(long)]
    plugins: PathBuf,
    /// Directory of the test plugins (widget.wasm).
    #[arg(long)]
    test_plugins: PathBuf,
    /// Where results (JSON), logs and work files go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// Small sizes and one trial: every scenario in seconds; checks only that each
    /// converges.
    #[arg(long)]
    quick: bool,
    /// Run only these scenarios (restart, uuid, widget, memory, hot-reload, shards,
    /// shadow, identities).
    #[arg(long = "only", value_delimiter = ',')]
    only: Vec<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = kube::Client::try_default()
        .await
        .context("no cluster: set KUBECONFIG (cargo xtask bench starts one)")?;
    let bench = Bench::new(
        client,
        Config {
            capstan: std::path::absolute(&args.capstan)?,
            native: std::path::absolute(&args.native)?,
            plugins: std::path::absolute(&args.plugins)?,
            test_plugins: std::path::absolute(&args.test_plugins)?,
            out: std::path::absolute(&args.out)?,
            quick: args.quick,
        },
    )
    .await?;
    if args.only.is_empty() {
        bench.run_all().await?;
    } else {
        for scenario in &args.only {
            match scenario.as_str() {
                "restart" => bench.restart().await?,
                "uuid" => bench.uuid().await?,
                "widget" => bench.widget().await?,
                "memory" => bench.memory().await?,
                "hot-reload" => bench.hot_reload().await?,
                "shards" => bench.shards().await?,
                "shadow" => bench.shadow().await?,
                "identities" => bench.identities().await?,
                other => anyhow::bail!("unknown scenario {other:?}"),
            }
        }
    }
    println!("\nresults: {}", args.out.join("*.json").display());
    Ok(())
}
