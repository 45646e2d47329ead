//! Results: each scenario prints a table and writes `<out>/<scenario>.json` with the
//! machine it ran on.

use std::path::Path;

use serde::Serialize;
use serde_json::{Value, json};

use crate::procfs;
use crate::{Error, Result};

/// A printed table.
pub struct Table {
    title: String,
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table with column names.
    pub fn new(title: &str, header: &[&str]) -> Self {
        Table {
            title: title.into(),
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (as many cells as columns).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Prints it to stdout, columns aligned, as Markdown (docs/performance.md takes it
    /// as it is).
    pub fn print(&self) {
        let mut widths: Vec<usize> = self.header.iter().map(String::len).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let padded: Vec<String> = cells
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            format!("| {} |", padded.join(" | "))
        };
        println!("\n### {}\n", self.title);
        println!("{}", line(&self.header));
        let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
        println!("{}", line(&rule));
        for row in &self.rows {
            println!("{}", line(row));
        }
    }
}

/// Writes `results` of `scenario` to `<out>/<scenario>.json`, with the machine.
pub fn write_json(
    out: &Path,
    scenario: &str,
    quick: bool,
    load_before: f64,
    results: &impl Serialize,
) -> Result<()> {
    let doc = json!({
        "scenario": scenario,
        "quick": quick,
        "machine": {
            "cpus": procfs::cpus(),
            "load_average_1m_before": load_before,
            "load_average_1m_after": procfs::load_average(),
        },
        "results": serde_json::to_value(results).unwrap_or(Value::Null),
    });
    std::fs::create_dir_all(out)
        .map_err(|e| Error::Setup(format!("create {}: {e}", out.display())))?;
    let path = out.join(format!("{scenario}.json"));
    let text = serde_json::to_string_pretty(&doc).expect("JSON serializes");
    std::fs::write(&path, text + "\n")
        .map_err(|e| Error::Setup(format!("write {}: {e}", path.display())))
}

/// Seconds with two decimals.
pub fn secs(s: f64) -> String {
    format!("{s:.2} s")
}

/// MiB with one decimal.
pub fn mib(m: f64) -> String {
    format!("{m:.1} MiB")
}

/// "ok" or "over" against a goal where smaller is better; quick runs are not judged.
pub fn against(value: f64, goal: f64, quick: bool) -> String {
    match (quick, value <= goal) {
        (true, _) => "quick".into(),
        (false, true) => "ok".into(),
        (false, false) => "over".into(),
    }
}
