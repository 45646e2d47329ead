//! Getting plugins where they run: `push` and `sign` (OCI registries, cosign),
//! `seed-plugins` and `precompile` (the image and its compiled code).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use capstan::oci::OciStore;
use capstan::plugin::{Sandbox, SandboxConfig};
use capstan::signature::SigningKey;

use super::RegistryAccessArgs;

/// `capstan seed-plugins`: the plugins of `src` copied into `dst` (each written aside,
/// then renamed), as the image's init container seeds the plugin volume.
pub fn seed_plugins(src: &Path, dst: &Path) -> Result<()> {
    for file in wasm_files(src)? {
        let name = file.file_name().expect("a file name");
        let tmp = dst.join(format!(".{}.tmp", name.to_string_lossy()));
        std::fs::copy(&file, &tmp).with_context(|| format!("cannot copy {}", file.display()))?;
        std::fs::rename(&tmp, dst.join(name))?;
        println!("{}", dst.join(name).display());
    }
    Ok(())
}

/// `capstan sign`: a cosign `sign-blob` signature of the component, beside it.
pub fn sign(plugin: &Path, key: &Path) -> Result<()> {
    let key = SigningKey::from_pem_file(key)?;
    let bytes =
        std::fs::read(plugin).with_context(|| format!("cannot read {}", plugin.display()))?;
    let sig = capstan::signature::sig_file_of(plugin);
    std::fs::write(&sig, key.sign(&bytes))
        .with_context(|| format!("cannot write {}", sig.display()))?;
    println!("{}", sig.display());
    Ok(())
}

/// `capstan precompile`: loads every plugin of `plugins` with `out` as the compile
/// cache, keeping each loaded until all are, so that none is evicted by the others.
pub fn precompile(plugins: &Path, out: &Path) -> Result<()> {
    let sandbox = Sandbox::new(SandboxConfig {
        cache_dir: Some(out.to_path_buf()),
        // As the other commands that load plugins: a plugin may run several core
        // instances (the Python plugin does), the pool's bound is per instance.
        instances: 4,
        ..SandboxConfig::default()
    })
    .context("cannot set up the plugin sandbox")?;
    let mut loaded = Vec::new();
    for file in wasm_files(plugins)? {
        let plugin = sandbox.load_file_blocking(&file)?;
        println!("{} {}", plugin.sha256(), file.display());
        loaded.push(plugin);
    }
    // The key the entries were sealed with stays here: a precompiled directory is
    // trusted as the image that ships it is, and read without a key.
    let key = out.join(".key");
    if key.exists() {
        std::fs::remove_file(&key).with_context(|| format!("remove {}", key.display()))?;
    }
    Ok(())
}

/// The `*.wasm` files of `dir`, sorted; none is an error.
pub fn wasm_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "wasm"));
    files.sort();
    anyhow::ensure!(!files.is_empty(), "no *.wasm plugin in {}", dir.display());
    Ok(files)
}

/// `capstan push`: the component to a tag (signed with a key), its digest printed.
pub fn push(
    plugin: &Path,
    reference: &str,
    sign_key: Option<&Path>,
    access: &RegistryAccessArgs,
) -> Result<()> {
    let bytes =
        std::fs::read(plugin).with_context(|| format!("cannot read {}", plugin.display()))?;
    // A component's preamble: `\0asm`, then version 0x0d and layer 1.
    anyhow::ensure!(
        bytes.starts_with(b"\0asm\x0d\x00\x01\x00"),
        "{} is not a WebAssembly component (a plugin is one: cargo component build, or \
         cargo build --target wasm32-wasip2)",
        plugin.display()
    );
    let parsed = capstan::oci::parse_reference(reference)?;
    anyhow::ensure!(
        parsed.digest().is_none(),
        "{reference}: push to a tag; the digest is what the push prints"
    );
    let key = sign_key.map(SigningKey::from_pem_file).transpose()?;
    let store = OciStore::new(access.options(None)?);
    let runtime = tokio::runtime::Runtime::new()?;
    let digest = runtime.block_on(store.push(&parsed, &bytes, key.as_ref()))?;
    println!(
        "{}{}/{}@{digest}",
        capstan::oci::SCHEME,
        parsed.registry(),
        parsed.repository()
    );
    Ok(())
}
