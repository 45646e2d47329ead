//! The `capstan` command: parses the command line and reports errors as one line.

use std::process::ExitCode;

use clap::Parser;

mod cli;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    cli::init_tracing(&args);
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("capstan: {}", cli::one_line(&err));
            ExitCode::FAILURE
        }
    }
}
