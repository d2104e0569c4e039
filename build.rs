//! Compiles `kernels/*.cu` to PTX with nvcc when the `cuda` feature is on; a CPU-only build
//! needs no CUDA toolkit and does nothing here.
//!
//! Every `.cu` file becomes `$OUT_DIR/<stem>.ptx` for the virtual architecture `compute_80`
//! (Ampere and later; the driver JIT-compiles it for the GPU at load time). A Hopper-only module
//! (wgmma/TMA) can be added to `MODULES` with its own `-gencode` target later and picked at run
//! time by compute capability in `src/cuda.rs`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Extra modules built for a specific architecture, on top of one `compute_80` PTX per `.cu`:
/// `(source file, output stem, nvcc target flags)`. Empty today.
const ARCH_MODULES: &[(&str, &str, &[&str])] = &[];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "NVCC_CCBIN"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let nvcc = find_nvcc();
    let mut sources: Vec<PathBuf> = std::fs::read_dir("kernels")
        .expect("kernels/ must exist")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();

    let mut jobs: Vec<(PathBuf, PathBuf, Vec<String>)> = sources
        .iter()
        .map(|src| {
            let stem = src.file_stem().unwrap().to_string_lossy().into_owned();
            (
                src.clone(),
                out_dir.join(format!("{stem}.ptx")),
                vec!["-arch=compute_80".to_string()],
            )
        })
        .collect();
    for (src, stem, flags) in ARCH_MODULES {
        jobs.push((
            PathBuf::from(src),
            out_dir.join(format!("{stem}.ptx")),
            flags.iter().map(|f| f.to_string()).collect(),
        ));
    }

    // The files are independent: compile them in parallel (the two big ones dominate).
    let handles: Vec<_> = jobs
        .into_iter()
        .map(|(src, out, flags)| {
            let nvcc = nvcc.clone();
            std::thread::spawn(move || compile(&nvcc, &src, &out, &flags))
        })
        .collect();
    for h in handles {
        if let Err(msg) = h.join().expect("nvcc thread panicked") {
            panic!("{msg}");
        }
    }
}

/// `NVCC`, then `$CUDA_HOME/bin/nvcc` (or `CUDA_PATH`), then `nvcc` from `PATH`.
fn find_nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        return PathBuf::from(p);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            let p = Path::new(&home).join("bin").join("nvcc");
            if p.exists() {
                return p;
            }
        }
    }
    PathBuf::from("nvcc")
}

fn compile(nvcc: &Path, src: &Path, out: &Path, target: &[String]) -> Result<(), String> {
    let mut cmd = Command::new(nvcc);
    cmd.arg("--ptx")
        .args(target)
        .args(["-O3", "-std=c++17", "-Ikernels"])
        .arg("-o")
        .arg(out)
        .arg(src);
    if let Some(ccbin) = std::env::var_os("NVCC_CCBIN") {
        cmd.arg("-ccbin").arg(ccbin);
    }
    let output = cmd.output().map_err(|e| {
        format!(
            "candle-flash: could not run nvcc ({}): {e}. Set NVCC or CUDA_HOME, or build without \
             the `cuda` feature.",
            nvcc.display()
        )
    })?;
    if !output.status.success() {
        return Err(format!(
            "candle-flash: nvcc failed on {} ({}):\n{}{}",
            src.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(())
}
