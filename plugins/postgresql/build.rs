//! Converts `crds/postgresqlcluster.yaml` to JSON for `describe`, so the sandbox never
//! parses YAML.

fn main() {
    let source = "../../crds/postgresqlcluster.yaml";
    println!("cargo::rerun-if-changed={source}");
    let yaml = std::fs::read_to_string(source).expect("read crds/postgresqlcluster.yaml");
    let crd: serde_json::Value =
        serde_yaml_ng::from_str(&yaml).expect("crds/postgresqlcluster.yaml is valid YAML");
    let out = std::path::Path::new(&std::env::var("OUT_DIR").unwrap()).join("crd.json");
    std::fs::write(out, crd.to_string()).expect("write crd.json");
}
