//! Where `scripts/fetch-models.sh` puts the pretrained weights, shared by the model examples and
//! `tests/models.rs`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// What a missing download tells the user to do.
pub const FETCH_HINT: &str =
    "run scripts/fetch-models.sh first (it installs the weights into models/)";

/// `models/` of this checkout. The crate root is baked in at compile time so that the examples
/// and tests find the weights whatever the working directory.
pub fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models")
}

/// The first file below `dir` whose name satisfies `matches` (directories visited in sorted
/// order, so the answer does not depend on the file system). `what` names it in the error.
pub fn find_file(dir: &Path, what: &str, matches: impl Fn(&str) -> bool) -> Result<PathBuf> {
    if !dir.is_dir() {
        bail!("{} does not exist: {FETCH_HINT}", dir.display());
    }
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let mut entries = std::fs::read_dir(&d)
            .with_context(|| format!("reading {}", d.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<Vec<_>>>()
            .with_context(|| format!("listing {}", d.display()))?;
        entries.sort();
        // Reverse so that popping the stack visits sub-directories in sorted order.
        for p in entries.into_iter().rev() {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if p.is_dir() {
                stack.push(p);
            } else if matches(name) {
                return Ok(p);
            }
        }
    }
    bail!("no {what} under {}: {FETCH_HINT}", dir.display())
}
