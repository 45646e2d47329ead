//! Container images without Docker: directories turned into an OCI image-layout tar.
//!
//! The tar holds `oci-layout`, `index.json` and `blobs/sha256/…` (one gzip layer per
//! directory, the image config and the manifest), as the OCI image-layout spec says. Its
//! index names the image both ways containerd reads a name (`io.containerd.image.name`
//! with the full reference, `org.opencontainers.image.ref.name` with the tag), so
//! `ctr -n k8s.io images import FILE` makes it what a Pod's `image: NAME` finds.
//!
//! Layers are reproducible: entries sorted by path, one fixed mtime, owners and modes as
//! the directory has them (so a rootfs built as root with `chown`ed files keeps them).
//! Device nodes, sockets and FIFOs are left out: the runtime provides `/dev`.

use std::{
    fs::{self, File},
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use flate2::{Compression, write::GzEncoder};
use sha2::{Digest, Sha256};

/// Every entry's mtime in a layer: 2000-01-01, so a rebuild of the same files gives the
/// same digests (a zero mtime upsets some tools).
const LAYER_MTIME: u64 = 946_684_800;

/// What the image's config says about how to run it.
#[derive(Debug, Clone, Default)]
pub struct ImageConfig {
    /// The reference Pods use, e.g. `postgres:16.15` or `ghcr.io/org/capstan:0.1.0`.
    pub name: String,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `KEY=value` entries.
    pub env: Vec<String>,
    /// `uid[:gid]` or a name from the image's /etc/passwd.
    pub user: Option<String>,
    pub workdir: Option<String>,
    /// e.g. `5432/tcp`.
    pub exposed_ports: Vec<String>,
    pub labels: Vec<(String, String)>,
    /// Declared volumes, e.g. `/var/lib/postgresql/data`.
    pub volumes: Vec<String>,
    /// Signal the runtime sends to stop the container (e.g. `SIGINT`).
    pub stop_signal: Option<String>,
}

/// What [`write_image`] made.
#[derive(Debug, Clone)]
pub struct Image {
    /// The tar file.
    pub path: PathBuf,
    /// The full reference it is imported as (`docker.io/library/postgres:16.15`).
    pub reference: String,
    /// `sha256:…` of the manifest: the image's identity in containerd.
    pub manifest_digest: String,
    /// Sum of the gzip layers' sizes: what a registry would transfer.
    pub compressed_bytes: u64,
    /// Sum of the layers' tar sizes: about what the unpacked image takes on disk.
    pub uncompressed_bytes: u64,
}

/// Writes the image made of `layers` (directories, lowest first; each becomes one layer
/// holding its contents relative to the directory) and `config` as an OCI image-layout
/// tar at `out`, written to a temporary name first so `out` is complete or absent.
pub fn write_image(layers: &[&Path], config: &ImageConfig, out: &Path) -> Result<Image> {
    if config.name.is_empty() {
        bail!("an image needs a name");
    }
    let reference = full_reference(&config.name)?;
    let work = out.with_extension("parts");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).with_context(|| format!("create {}", work.display()))?;
    let result = write_parts(layers, config, &reference, &work, out);
    let _ = fs::remove_dir_all(&work);
    result
}

fn write_parts(
    layers: &[&Path],
    config: &ImageConfig,
    reference: &str,
    work: &Path,
    out: &Path,
) -> Result<Image> {
    let mut blobs: Vec<Blob> = Vec::new();
    let mut layer_descriptors = Vec::new();
    let mut diff_ids = Vec::new();
    let (mut compressed_bytes, mut uncompressed_bytes) = (0, 0);
    for (i, dir) in layers.iter().enumerate() {
        let layer = write_layer(dir, &work.join(format!("layer-{i}.tar.gz")))
            .with_context(|| format!("make a layer of {}", dir.display()))?;
        compressed_bytes += layer.blob.size;
        uncompressed_bytes += layer.tar_size;
        layer_descriptors.push(descriptor(
            "application/vnd.oci.image.layer.v1.tar+gzip",
            &layer.blob,
            "",
        ));
        diff_ids.push(json_string(&layer.diff_id));
        blobs.push(layer.blob);
    }

    let config_json = config_json(config, &diff_ids);
    let config_blob = Blob::from_bytes(work, "config.json", config_json.as_bytes())?;
    let manifest_json = format!(
        "{{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\
         \"config\":{},\"layers\":[{}]}}",
        descriptor("application/vnd.oci.image.config.v1+json", &config_blob, ""),
        layer_descriptors.join(",")
    );
    let manifest_blob = Blob::from_bytes(work, "manifest.json", manifest_json.as_bytes())?;
    let tag = reference.rsplit_once(':').map_or("latest", |(_, tag)| tag);
    let annotations = format!(
        ",\"platform\":{{\"architecture\":\"amd64\",\"os\":\"linux\"}},\"annotations\":{{\
         \"io.containerd.image.name\":{},\"org.opencontainers.image.ref.name\":{}}}",
        json_string(reference),
        json_string(tag)
    );
    let index_json = format!(
        "{{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.index.v1+json\",\
         \"manifests\":[{}]}}",
        descriptor(
            "application/vnd.oci.image.manifest.v1+json",
            &manifest_blob,
            &annotations
        )
    );
    let manifest_digest = manifest_blob.digest.clone();
    blobs.push(config_blob);
    blobs.push(manifest_blob);

    let partial = out.with_extension("partial");
    {
        let file =
            File::create(&partial).with_context(|| format!("create {}", partial.display()))?;
        let mut tar = tar::Builder::new(BufWriter::new(file));
        append_bytes(
            &mut tar,
            "oci-layout",
            b"{\"imageLayoutVersion\":\"1.0.0\"}",
        )?;
        append_bytes(&mut tar, "index.json", index_json.as_bytes())?;
        for blob in &blobs {
            let name = format!("blobs/sha256/{}", blob.hex());
            let mut header = file_header(blob.size, 0o644);
            tar.append_data(&mut header, &name, File::open(&blob.path)?)
                .with_context(|| format!("write {name}"))?;
        }
        tar.into_inner()?.flush()?;
    }
    fs::rename(&partial, out).with_context(|| format!("move {} into place", out.display()))?;
    Ok(Image {
        path: out.to_path_buf(),
        reference: reference.to_owned(),
        manifest_digest,
        compressed_bytes,
        uncompressed_bytes,
    })
}

/// `postgres:16.15` → `docker.io/library/postgres:16.15`, as the kubelet asks containerd
/// for it; a reference with a registry host is kept. A reference without a tag gets
/// `latest`.
pub fn full_reference(name: &str) -> Result<String> {
    if name.contains('@') || name.chars().any(char::is_whitespace) {
        bail!("image name {name:?}: give NAME[:TAG] (no digest, no spaces)");
    }
    let (path, tag) = match name.rsplit_once(':') {
        Some((path, tag)) if !tag.contains('/') => (path, tag),
        _ => (name, "latest"),
    };
    let first = path.split('/').next().unwrap_or_default();
    let has_host =
        path.contains('/') && (first.contains('.') || first.contains(':') || first == "localhost");
    let path = match (has_host, path.contains('/')) {
        (true, _) => path.to_owned(),
        (false, true) => format!("docker.io/{path}"),
        (false, false) => format!("docker.io/library/{path}"),
    };
    Ok(format!("{path}:{tag}"))
}

/// A blob written to the work directory, with its digest and size.
struct Blob {
    path: PathBuf,
    digest: String,
    size: u64,
}

impl Blob {
    fn from_bytes(work: &Path, name: &str, bytes: &[u8]) -> Result<Self> {
        let path = work.join(name);
        fs::write(&path, bytes).with_context(|| format!("write {}", path.display()))?;
        Ok(Self {
            path,
            digest: format!("sha256:{:x}", Sha256::digest(bytes)),
            size: bytes.len() as u64,
        })
    }

    fn hex(&self) -> &str {
        self.digest.trim_start_matches("sha256:")
    }
}

struct Layer {
    blob: Blob,
    /// `sha256:` of the uncompressed tar: the config's `rootfs.diff_ids`.
    diff_id: String,
    tar_size: u64,
}

/// Counts and hashes what passes through to `inner`.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Hashing<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            hash: Sha256::new(),
            bytes: 0,
        }
    }

    fn finish(self) -> (W, String, u64) {
        (
            self.inner,
            format!("sha256:{:x}", self.hash.finalize()),
            self.bytes,
        )
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// The tar of `dir`'s contents, gzip-compressed into `out`.
fn write_layer(dir: &Path, out: &Path) -> Result<Layer> {
    if !dir.is_dir() {
        bail!("{} is not a directory", dir.display());
    }
    let file = File::create(out).with_context(|| format!("create {}", out.display()))?;
    let compressed = Hashing::new(BufWriter::new(file));
    let gzip = GzEncoder::new(compressed, Compression::default());
    let mut tar = tar::Builder::new(Hashing::new(gzip));
    tar.follow_symlinks(false);
    let mut entries = Vec::new();
    collect(dir, &mut entries)?;
    for path in entries {
        append_entry(&mut tar, dir, &path)?;
    }
    let (gzip, diff_id, tar_size) = tar.into_inner()?.finish();
    let (file, digest, size) = gzip.finish()?.finish();
    file.into_inner()
        .map_err(|err| err.into_error())?
        .sync_all()?;
    Ok(Layer {
        blob: Blob {
            path: out.to_path_buf(),
            digest,
            size,
        },
        diff_id,
        tar_size,
    })
}

/// Every path under `dir`, parents before children, sorted by name.
fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut children: Vec<PathBuf> = fs::read_dir(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<io::Result<_>>()?;
    children.sort();
    for child in children {
        let meta = fs::symlink_metadata(&child)?;
        out.push(child.clone());
        if meta.is_dir() {
            collect(&child, out)?;
        }
    }
    Ok(())
}

fn append_entry<W: Write>(tar: &mut tar::Builder<W>, root: &Path, path: &Path) -> Result<()> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = fs::symlink_metadata(path)?;
    let kind = meta.file_type();
    if kind.is_block_device() || kind.is_char_device() || kind.is_fifo() || kind.is_socket() {
        return Ok(());
    }
    let name = path.strip_prefix(root)?;
    let mut header = tar::Header::new_gnu();
    header.set_metadata_in_mode(&meta, tar::HeaderMode::Complete);
    header.set_mtime(LAYER_MTIME);
    header.set_uid(meta.uid().into());
    header.set_gid(meta.gid().into());
    let shown = || format!("add {} to a layer", path.display());
    if kind.is_symlink() {
        let target = fs::read_link(path)?;
        header.set_size(0);
        tar.append_link(&mut header, name, &target)
            .with_context(shown)?;
    } else if kind.is_dir() {
        header.set_size(0);
        tar.append_data(&mut header, name, io::empty())
            .with_context(shown)?;
    } else {
        tar.append_data(&mut header, name, File::open(path)?)
            .with_context(shown)?;
    }
    Ok(())
}

fn file_header(size: u64, mode: u32) -> tar::Header {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(size);
    header.set_mode(mode);
    header.set_mtime(LAYER_MTIME);
    header
}

fn append_bytes<W: Write>(tar: &mut tar::Builder<W>, name: &str, bytes: &[u8]) -> Result<()> {
    let mut header = file_header(bytes.len() as u64, 0o644);
    tar.append_data(&mut header, name, bytes)
        .with_context(|| format!("write {name}"))
}

fn descriptor(media_type: &str, blob: &Blob, extra: &str) -> String {
    format!(
        "{{\"mediaType\":{},\"digest\":{},\"size\":{}{extra}}}",
        json_string(media_type),
        json_string(&blob.digest),
        blob.size
    )
}

fn config_json(config: &ImageConfig, diff_ids: &[String]) -> String {
    let strings = |items: &[String]| {
        let items: Vec<String> = items.iter().map(|s| json_string(s)).collect();
        format!("[{}]", items.join(","))
    };
    let set = |items: &[String]| {
        let items: Vec<String> = items
            .iter()
            .map(|s| format!("{}:{{}}", json_string(s)))
            .collect();
        format!("{{{}}}", items.join(","))
    };
    let mut fields = vec![
        format!("\"Env\":{}", strings(&config.env)),
        format!("\"Entrypoint\":{}", strings(&config.entrypoint)),
        format!("\"Cmd\":{}", strings(&config.cmd)),
        format!("\"ExposedPorts\":{}", set(&config.exposed_ports)),
        format!("\"Volumes\":{}", set(&config.volumes)),
    ];
    if let Some(user) = &config.user {
        fields.push(format!("\"User\":{}", json_string(user)));
    }
    if let Some(dir) = &config.workdir {
        fields.push(format!("\"WorkingDir\":{}", json_string(dir)));
    }
    if let Some(signal) = &config.stop_signal {
        fields.push(format!("\"StopSignal\":{}", json_string(signal)));
    }
    let labels: Vec<String> = config
        .labels
        .iter()
        .map(|(k, v)| format!("{}:{}", json_string(k), json_string(v)))
        .collect();
    fields.push(format!("\"Labels\":{{{}}}", labels.join(",")));
    format!(
        "{{\"architecture\":\"amd64\",\"os\":\"linux\",\"created\":\"2000-01-01T00:00:00Z\",\
         \"config\":{{{}}},\"rootfs\":{{\"type\":\"layers\",\"diff_ids\":[{}]}}}}",
        fields.join(","),
        diff_ids.join(",")
    )
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, io::Read, os::unix::fs::symlink};

    use super::*;

    #[test]
    fn references_are_completed_as_the_kubelet_asks_for_them() {
        let cases = [
            ("postgres:16.15", "docker.io/library/postgres:16.15"),
            ("capstan", "docker.io/library/capstan:latest"),
            ("org/capstan:0.1.0", "docker.io/org/capstan:0.1.0"),
            ("ghcr.io/org/capstan:0.1.0", "ghcr.io/org/capstan:0.1.0"),
            ("localhost:5000/capstan", "localhost:5000/capstan:latest"),
        ];
        for (name, want) in cases {
            assert_eq!(full_reference(name).unwrap(), want, "{name}");
        }
        assert!(full_reference("x@sha256:00").is_err());
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_string("a\"b\\c\n\u{1}"), r#""a\"b\\c\n\u0001""#);
    }

    /// The tar's entries by name.
    fn entries(tar_path: &Path) -> BTreeMap<String, Vec<u8>> {
        let mut archive = tar::Archive::new(File::open(tar_path).unwrap());
        let mut out = BTreeMap::new();
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let name = entry.path().unwrap().display().to_string();
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes).unwrap();
            out.insert(name, bytes);
        }
        out
    }

    #[test]
    fn writes_a_layout_whose_digests_and_layer_match() {
        let tmp = std::env::temp_dir().join(format!("capstan-oci-{}", std::process::id()));
        let _ = fs::remove_dir_all(&tmp);
        let root = tmp.join("rootfs");
        fs::create_dir_all(root.join("usr/bin")).unwrap();
        fs::write(root.join("usr/bin/hello"), b"#!/bin/sh\necho hi\n").unwrap();
        symlink("usr/bin", root.join("bin")).unwrap();
        let config = ImageConfig {
            name: "hello:1.0".into(),
            entrypoint: vec!["/usr/bin/hello".into()],
            user: Some("65532:65532".into()),
            ..ImageConfig::default()
        };
        let out = tmp.join("hello.tar");
        let image = write_image(&[&root], &config, &out).unwrap();
        assert_eq!(image.reference, "docker.io/library/hello:1.0");

        let files = entries(&out);
        let index = String::from_utf8(files["index.json"].clone()).unwrap();
        assert!(index.contains("\"io.containerd.image.name\":\"docker.io/library/hello:1.0\""));
        assert!(index.contains(&image.manifest_digest));
        // Every blob is named by its own digest.
        for (name, bytes) in &files {
            if let Some(hex) = name.strip_prefix("blobs/sha256/") {
                assert_eq!(format!("{:x}", Sha256::digest(bytes)), hex, "{name}");
            }
        }
        // The one layer holds the files, the symlink kept as one, at relative paths.
        let manifest = &files[&format!(
            "blobs/sha256/{}",
            image.manifest_digest.trim_start_matches("sha256:")
        )];
        let manifest = String::from_utf8(manifest.clone()).unwrap();
        let layer_digest = manifest
            .split("\"layers\":[")
            .nth(1)
            .and_then(|rest| rest.split("\"digest\":\"sha256:").nth(1))
            .and_then(|rest| rest.split('"').next())
            .unwrap();
        let gz = &files[&format!("blobs/sha256/{layer_digest}")];
        let mut layer = tar::Archive::new(flate2::read::GzDecoder::new(&gz[..]));
        let mut seen = BTreeMap::new();
        for entry in layer.entries().unwrap() {
            let entry = entry.unwrap();
            let name = entry.path().unwrap().display().to_string();
            let link = entry.link_name().unwrap().map(|l| l.display().to_string());
            seen.insert(name, (entry.header().entry_type(), link));
        }
        assert_eq!(
            seen.keys().collect::<Vec<_>>(),
            ["bin", "usr", "usr/bin", "usr/bin/hello"]
        );
        assert_eq!(seen["bin"].0, tar::EntryType::Symlink);
        assert_eq!(seen["bin"].1.as_deref(), Some("usr/bin"));
        // The config names the layer's uncompressed digest and the entrypoint.
        let config_digest = manifest
            .split("\"config\":{")
            .nth(1)
            .and_then(|rest| rest.split("\"digest\":\"sha256:").nth(1))
            .and_then(|rest| rest.split('"').next())
            .unwrap();
        let config =
            String::from_utf8(files[&format!("blobs/sha256/{config_digest}")].clone()).unwrap();
        assert!(config.contains("\"Entrypoint\":[\"/usr/bin/hello\"]"));
        assert!(config.contains("\"User\":\"65532:65532\""));

        // The same files give the same image.
        let again = write_image(
            &[&root],
            &ImageConfig {
                name: "hello:1.0".into(),
                entrypoint: vec!["/usr/bin/hello".into()],
                user: Some("65532:65532".into()),
                ..ImageConfig::default()
            },
            &tmp.join("again.tar"),
        )
        .unwrap();
        assert_eq!(again.manifest_digest, image.manifest_digest);
        fs::remove_dir_all(&tmp).unwrap();
    }
}
