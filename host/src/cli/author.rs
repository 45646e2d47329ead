//! `capstan new`, `capstan build` and `capstan test`: plugin projects outside this
//! repository.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};

use super::SandboxArgs;

/// `capstan new`: a project from the template of its language.
pub fn new(options: capstan::author::scaffold::NewOptions) -> Result<()> {
    let dir = capstan::author::scaffold::create(Path::new("."), &options)?;
    println!(
        "created {}: `cd {0} && capstan build && capstan test`",
        dir.display()
    );
    Ok(())
}

/// `capstan build`: the project's build command, with the pinned toolchain; prints
/// only the component's path.
pub fn build(dir: &Path) -> Result<()> {
    let project = capstan::author::project::Project::open(dir)?;
    let built = project.build()?;
    println!("{}", built.display());
    Ok(())
}

/// `capstan test`: every sample rendered and compared with its golden file (or written
/// into it with `--update`); one line per sample, the differing fields under a failing
/// one, then a summary. Exit 1 when a sample differs or has no golden file.
pub fn test(dir: &Path, update: bool, sandbox: &SandboxArgs) -> Result<ExitCode> {
    use capstan::author::samples::{self, Verdict};
    let project = capstan::author::project::Project::open(dir)?;
    let plugin = sandbox.load(&project.built_output()?)?;
    let found = samples::find(&project.dir.join("samples"))?;
    let (mut failed, mut written) = (0, 0);
    for sample in &found {
        let rendered = samples::render_sample(&plugin, sample)?;
        let golden = match std::fs::read_to_string(&sample.golden) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("read {}", sample.golden.display())),
        };
        let verdict = samples::compare(golden.as_deref(), &rendered);
        let shown = sample.parent.display();
        match (verdict, update) {
            (Verdict::Same, _) => println!("ok      {shown}"),
            (_, true) => {
                std::fs::write(&sample.golden, &rendered)
                    .with_context(|| format!("write {}", sample.golden.display()))?;
                written += 1;
                println!("updated {}", sample.golden.display());
            }
            (Verdict::NoGolden, false) => {
                failed += 1;
                println!(
                    "FAILED  {shown}: no golden file {} (`capstan test --update` writes it)",
                    sample.golden.display()
                );
            }
            (Verdict::Differs(fields), false) => {
                failed += 1;
                println!(
                    "FAILED  {shown}: differs from {} (golden -> rendered):",
                    sample.golden.display()
                );
                print!("{fields}");
            }
        }
    }
    let total = found.len();
    match (failed, written) {
        (0, 0) => println!("{total} samples: all match their golden files"),
        (0, n) => println!("{total} samples: {n} golden files written"),
        (n, _) => {
            println!(
                "{total} samples: {n} failed (`capstan test --update` accepts what they render now)"
            );
            return Ok(ExitCode::from(1));
        }
    }
    Ok(ExitCode::SUCCESS)
}
