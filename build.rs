//! Compiles `kernels/*.cu` to PTX with nvcc when the `cuda` feature is on; a CPU-only build
//! needs no CUDA toolkit and does nothing here.
//!
//! Every `.cu` file at the top of `kernels/` is one module and becomes `$OUT_DIR/<stem>.ptx` for
//! the virtual architecture `compute_80` (Ampere and later; the driver JIT-compiles it for the
//! GPU at load time). Headers are grouped by pass under `kernels/common`, `kernels/forward` (and
//! later `decode`, `backward`, `sm90`). Architecture-specific modules live in subfolders and are
//! listed in `ARCH_MODULES` with their own `-gencode` target: the Hopper forward
//! `kernels/sm90/flash_sm90.cu` and backward `kernels/sm90/bwd_sm90.cu` (wgmma/TMA,
//! `compute_90a`), picked at run time by compute capability in `src/cuda/forward/plan.rs` and
//! `src/cuda/backward/plan.rs`, the decode instances with warpgroup-MMA products
//! `kernels/decode/decode_sm90.cu` (`compute_90a`), and the FP8-cache decode
//! `kernels/decode/decode_fp8.cu` (`compute_89`, and `compute_80` for older GPUs).
//!
//! Two headers are generated into `$OUT_DIR` from the Rust sources, so Rust and CUDA cannot
//! drift apart:
//! - `instances.cuh`: the kernel entry points of `src/cuda/instances.rs`, each with the
//!   shared-memory size the planner assumes (the kernels `static_assert` it);
//! - `params_layout.cuh`: the size and every field offset of `Params` (`src/cuda/params.rs`),
//!   which `kernels/common/params.cuh` `static_assert`s against `FlashParams`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

#[allow(dead_code)]
mod instances {
    include!("src/cuda/instances.rs");
}
#[allow(dead_code)]
mod params {
    include!("src/cuda/params.rs");
}
#[allow(dead_code)]
mod bwd_instances {
    include!("src/cuda/backward/instances.rs");
}

/// Extra modules built for a specific architecture, on top of one `compute_80` PTX per `.cu`:
/// `(source file, output stem, nvcc target flags)`: the sm_90a (Hopper) forward module, loaded
/// on compute capability 9.0 only (wgmma and setmaxnreg need the `a` target).
const ARCH_MODULES: &[(&str, &str, &[&str])] = &[
    (
        "kernels/sm90/flash_sm90.cu",
        "flash_sm90",
        &["-gencode=arch=compute_90a,code=compute_90a"],
    ),
    (
        "kernels/sm90/bwd_sm90.cu",
        "flash_bwd_sm90",
        &["-gencode=arch=compute_90a,code=compute_90a"],
    ),
    // Decode with the tile products on the warpgroup MMA (its `wg` instances).
    (
        "kernels/decode/decode_sm90.cu",
        "flash_decode_sm90",
        &["-gencode=arch=compute_90a,code=compute_90a"],
    ),
    // Decode from FP8 caches: with sm_89's e4m3 -> f16 conversion instruction, and for the
    // GPUs before it (and the portable path) with the conversion in integer and f16 arithmetic.
    (
        "kernels/decode/decode_fp8.cu",
        "flash_decode_fp8",
        &["-gencode=arch=compute_89,code=compute_89"],
    ),
    (
        "kernels/decode/decode_fp8.cu",
        "flash_decode_fp8_sm80",
        &["-arch=compute_80"],
    ),
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=src/cuda/instances.rs");
    println!("cargo:rerun-if-changed=src/cuda/params.rs");
    println!("cargo:rerun-if-changed=src/cuda/backward/instances.rs");
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "NVCC_CCBIN"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    write(&out_dir.join("instances.cuh"), &instances_header());
    write(&out_dir.join("params_layout.cuh"), &params_header());
    write(&out_dir.join("bwd_instances.cuh"), &bwd_instances_header());
    write(&out_dir.join("bwd_params_layout.cuh"), &bwd_params_header());
    // Which source tree this PTX comes from: worktrees sharing a target dir share this out dir,
    // and cargo reruns this script for a tree only when its kernels are newer than the last run
    // (of any tree). scripts/test-bin.sh reads it to force a rerun before packing binaries.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR is set by cargo");
    write(&out_dir.join("source_dir.txt"), &manifest);
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

    // Cargo reruns this script when any watched file changes, also where no nvcc input did (a
    // planner column of instances.rs): skip nvcc when its inputs hash as they did last time.
    let stamp = out_dir.join("ptx.stamp");
    let fingerprint = format!("{:016x}", inputs_hash(&nvcc, &jobs, &out_dir));
    if jobs.iter().all(|(_, out, _)| out.exists())
        && std::fs::read_to_string(&stamp).ok().as_deref() == Some(fingerprint.as_str())
    {
        return;
    }
    let _ = std::fs::remove_file(&stamp);

    // The files are independent: compile them in parallel (the two big ones dominate).
    let handles: Vec<_> = jobs
        .into_iter()
        .map(|(src, out, flags)| {
            let nvcc = nvcc.clone();
            let include = out_dir.clone();
            std::thread::spawn(move || compile(&nvcc, &src, &out, &flags, &include))
        })
        .collect();
    for h in handles {
        if let Err(msg) = h.join().expect("nvcc thread panicked") {
            panic!("{msg}");
        }
    }
    write(&stamp, &fingerprint);
}

/// FNV-1a over everything nvcc reads: its path, each job's source, output and flags, the
/// generated headers and every file under kernels/.
fn inputs_hash(nvcc: &Path, jobs: &[(PathBuf, PathBuf, Vec<String>)], out_dir: &Path) -> u64 {
    fn files(dir: &Path, ext: Option<&str>, acc: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                files(&p, ext, acc);
            } else if ext.is_none_or(|x| p.extension().is_some_and(|e| e == x)) {
                acc.push(p);
            }
        }
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    };
    eat(nvcc.as_os_str().as_encoded_bytes());
    for (src, out, flags) in jobs {
        eat(src.as_os_str().as_encoded_bytes());
        eat(out.as_os_str().as_encoded_bytes());
        eat(flags.join(" ").as_bytes());
    }
    let mut paths = Vec::new();
    files(Path::new("kernels"), None, &mut paths);
    files(out_dir, Some("cuh"), &mut paths);
    paths.sort();
    for p in paths {
        eat(p.as_os_str().as_encoded_bytes());
        eat(&std::fs::read(&p).unwrap_or_default());
    }
    h
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

fn compile(
    nvcc: &Path,
    src: &Path,
    out: &Path,
    target: &[String],
    include: &Path,
) -> Result<(), String> {
    let mut cmd = Command::new(nvcc);
    cmd.arg("--ptx")
        .args(target)
        .args(["-O3", "-std=c++17", "-Ikernels"])
        .arg(format!("-I{}", include.display()))
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

fn write(path: &Path, text: &str) {
    // Rewrite only on change, so nvcc's inputs keep their timestamps.
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    }
}

/// `FLASH_MMA_INSTANCES(PREFIX, T)`, `FLASH_F32_INSTANCES` and `FLASH_DECODE_INSTANCES(PREFIX, T)`,
/// one line per table row.
fn instances_header() -> String {
    use instances::{DECODE_INSTANCES, F32_INSTANCES, MMA_INSTANCES, SM90_INSTANCES};
    let mut h = String::from(
        "// Generated by build.rs from src/cuda/instances.rs: do not edit.\n#pragma once\n\n\
         #define FLASH_MMA_INSTANCES(PREFIX, T)",
    );
    for i in MMA_INSTANCES {
        write!(
            h,
            " \\\n    FLASH_MMA_INSTANCE(PREFIX##_{}, T, {}, {}, {}, {}, {}, {}, {}, {})",
            i.suffix(),
            i.d,
            i.dv,
            i.mt,
            i.bc,
            i.warps,
            i.stages,
            i.min_blocks,
            i.smem()
        )
        .unwrap();
    }
    h.push_str("\n\n#define FLASH_F32_INSTANCES");
    for i in F32_INSTANCES {
        write!(
            h,
            " \\\n    FLASH_F32_INSTANCE(flash_fwd_f32_{}, {}, {}, {})",
            i.suffix(),
            i.d,
            i.bc,
            i.smem()
        )
        .unwrap();
    }
    // The decode instances (mma.sync, and the warpgroup-MMA ones of the sm_90a module) and the
    // FP8-cache twins of the mma.sync ones: the same tiles, their own shared memory.
    type Smem = fn(&instances::DecodeInstance) -> usize;
    let decode: [(&str, &str, Smem, bool); 3] = [
        (
            "FLASH_DECODE_INSTANCES",
            "FLASH_DECODE_INSTANCE",
            |i| i.smem(),
            false,
        ),
        (
            "FLASH_DECODE_WG_INSTANCES",
            "FLASH_DECODE_WG_INSTANCE",
            |i| i.smem(),
            true,
        ),
        (
            "FLASH_DECODE_KV8_INSTANCES",
            "FLASH_DECODE_KV8_INSTANCE",
            |i| i.smem_kv8(),
            false,
        ),
    ];
    for (list, one, smem, wg) in decode {
        write!(h, "\n\n#define {list}(PREFIX, T)").unwrap();
        for i in DECODE_INSTANCES.iter().filter(|i| i.wg == wg) {
            write!(
                h,
                " \\\n    {one}(PREFIX##_{}, T, {}, {}, {}, {}, {}, {})",
                i.suffix(),
                i.d,
                i.rg,
                i.kg,
                i.bc,
                i.stages,
                smem(i)
            )
            .unwrap();
        }
    }
    h.push_str("\n\n#define FLASH_SM90_INSTANCES(T, TN)");
    for i in SM90_INSTANCES {
        write!(
            h,
            " \\\n    FLASH_SM90_INSTANCE(flash_fwd_sm90_##TN##_{}, T, {}, {}, {}, {}, {}, {}, {}, {}, {})",
            i.suffix(),
            i.d,
            i.nwg,
            i.bn,
            i.stages,
            i.pingpong,
            i.persistent,
            i.mods,
            i.blocks,
            i.smem()
        )
        .unwrap();
    }
    h.push_str("\n\n#define FLASH_SM90_FP8_INSTANCES");
    for i in instances::SM90_FP8_INSTANCES {
        write!(
            h,
            " \\\n    FLASH_SM90_FP8_INSTANCE(flash_fwd_sm90_e4m3_{}, {}, {}, {}, {}, {}, {}, {})",
            i.suffix(),
            i.d,
            i.nwg,
            i.bn,
            i.stages,
            i.pingpong,
            i.persistent,
            i.smem_fp8()
        )
        .unwrap();
    }
    h.push('\n');
    h
}

/// `static_assert`s on the size and every field offset of `FlashParams`, from `Params`: the
/// fields are read from src/cuda/params.rs, laid out by C rules from their types, and the total
/// is checked against the compiler's own `size_of::<Params>()`.
fn params_header() -> String {
    let (h, size) = layout_header("src/cuda/params.rs", "Params", "FlashParams");
    assert_eq!(
        size,
        std::mem::size_of::<params::Params>(),
        "the C layout computed from src/cuda/params.rs differs from rustc's"
    );
    h
}

/// The same for `BwdParams` (in the same file, which asserts its size on the Rust side): its
/// first field is the whole forward struct, checked by [`params_header`].
fn bwd_params_header() -> String {
    let (h, size) = layout_header("src/cuda/params.rs", "BwdParams", "BwdParams");
    assert_eq!(size, std::mem::size_of::<params::BwdParams>());
    h
}

/// `static_assert`s on the size and every field offset of the C struct `c_struct`, computed by C
/// layout rules from the fields of the Rust `#[repr(C)]` struct `rust_struct` in `path` (u64, i64,
/// f64, u32, i32, f32, or `Params`: the whole forward struct, called `f` on the C side). Returns
/// the header and the computed size.
fn layout_header(path: &str, rust_struct: &str, c_struct: &str) -> (String, usize) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let body = text
        .split(&format!("pub struct {rust_struct} {{"))
        .nth(1)
        .and_then(|b| b.split('}').next())
        .unwrap_or_else(|| panic!("struct {rust_struct} in {path}"));
    let mut h = format!("// Generated by build.rs from {path}: do not edit.\n#pragma once\n");
    let (mut offset, mut align) = (0usize, 1usize);
    for line in body
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("pub "))
    {
        let (name, ty) = line
            .trim_start_matches("pub ")
            .trim_end_matches(',')
            .split_once(": ")
            .unwrap_or_else(|| panic!("unparsed field in {rust_struct}: {line}"));
        let (size, c_name) = match ty {
            "Params" => (params::PARAMS_SIZE, "f"),
            "u64" | "i64" | "f64" => (8, name),
            "u32" | "i32" | "f32" => (4, name),
            _ => panic!("{rust_struct} field {name}: type {ty} has no C layout rule here"),
        };
        let field_align = size.min(8);
        offset = offset.next_multiple_of(field_align);
        align = align.max(field_align);
        writeln!(
            h,
            "static_assert(offsetof({c_struct}, {c_name}) == {offset}, \
             \"{c_struct}.{c_name} is not where {path} puts it\");"
        )
        .unwrap();
        offset += size;
    }
    let size = offset.next_multiple_of(align);
    writeln!(
        h,
        "static_assert(sizeof({c_struct}) == {size}, \"{c_struct}: C and Rust sizes differ\");"
    )
    .unwrap();
    (h, size)
}

/// `FLASH_BWD_MMA_INSTANCES(PREFIX, T)`: the tensor-core backward entry points of
/// src/cuda/backward/instances.rs, one line per head dim, with the shared memory the planner
/// assumes.
fn bwd_instances_header() -> String {
    let mut h = String::from(
        "// Generated by build.rs from src/cuda/backward/instances.rs: do not edit.\n#pragma once\n\n\
         #define FLASH_BWD_MMA_INSTANCES(PREFIX, T)",
    );
    for i in bwd_instances::BWD_MMA {
        write!(
            h,
            " \\\n    FLASH_BWD_MMA_INSTANCE(PREFIX, T, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {})",
            i.d,
            i.kv_bm,
            i.kv_warps,
            i.kv_min_blocks,
            i.kv_smem(),
            bwd_instances::EXTRAS_KV_BM,
            i.kv_smem_extras(),
            i.q_bn,
            i.q_warps,
            i.q_min_blocks,
            i.q_smem()
        )
        .unwrap();
    }
    h.push_str("\n\n#define FLASH_BWD_SM90_INSTANCES(TN, T)");
    for i in bwd_instances::BWD_SM90 {
        let kind = if i.dkdv() { "DKDV" } else { "DQ" };
        let mods: &[bool] = if i.mods { &[false, true] } else { &[false] };
        for &m in mods {
            for varlen in [false, true] {
                write!(
                    h,
                    " \\\n    FLASH_BWD_SM90_{kind}(flash_bwd_sm90_##TN##_{}{}{}, T, {}, {}, {}, {}, {}, {}, {}, {})",
                    i.name,
                    if varlen { "_varlen" } else { "" },
                    if m { "_mods" } else { "" },
                    i.d,
                    i.rows,
                    i.stages,
                    i.overlap,
                    i.pingpong,
                    m,
                    varlen,
                    i.smem()
                )
                .unwrap();
            }
        }
    }
    h.push('\n');
    h
}
