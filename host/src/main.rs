//! The `capstan` command: parses the command line and reports errors as one line.

use std::process::ExitCode;

use clap::Parser;

mod cli;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    cli::init_tracing(&args);
    let failure = args.failure_code();
    match cli::run(args) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("capstan: {}", cli::one_line(&*err));
            ExitCode::from(failure)
        }
    }
}
