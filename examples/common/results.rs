//! Benchmark results as data: every benchmark writes one CSV file whose first four columns say
//! where the numbers come from (`date`, `commit`, `device`, `command`), followed by its own
//! columns. `bench/report.py` turns the committed files under `bench/results/` into
//! `docs/benchmarks.md` and its plots; history lives in git, not in the files.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use candle::Device;

/// A CSV file being written: the header on creation, then one line per [`row`](Self::row).
pub struct Csv {
    file: std::io::BufWriter<std::fs::File>,
    prefix: String,
    columns: usize,
}

impl Csv {
    /// Creates (or truncates) `path` for results of `dev` with the given workload columns.
    pub fn create(path: &Path, dev: &Device, columns: &[&str]) -> Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let file =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut file = std::io::BufWriter::new(file);
        writeln!(file, "date,commit,device,command,{}", columns.join(","))?;
        let prefix = [today(), commit(), device_name(dev), command()]
            .map(|f| quote(&f))
            .join(",");
        Ok(Self {
            file,
            prefix,
            columns: columns.len(),
        })
    }

    /// Appends one row; `values` are in the order of the columns given to [`create`](Self::create).
    pub fn row(&mut self, values: &[String]) -> Result<()> {
        anyhow::ensure!(
            values.len() == self.columns,
            "{} values for {} columns",
            values.len(),
            self.columns
        );
        let values: Vec<String> = values.iter().map(|v| quote(v)).collect();
        writeln!(self.file, "{},{}", self.prefix, values.join(","))?;
        // Flushed per row, so a run stopped at a time limit keeps what it measured.
        self.file.flush()?;
        Ok(())
    }
}

/// Quotes a field that holds a comma, a quote or a line break (RFC 4180).
fn quote(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Today's UTC date, `YYYY-MM-DD`, from the system clock (days since 1970 to a civil date).
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// The commit the binary was built from: `BENCH_COMMIT` (set by scripts/gpu-run.sh from the
/// packed binaries' build, where the machine has no git checkout), else `git rev-parse`, with
/// `-dirty` when the checkout has uncommitted changes.
pub fn commit() -> String {
    if let Ok(c) = std::env::var("BENCH_COMMIT") {
        return c;
    }
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        None => "unknown".into(),
        Some(c) => match git(&["status", "--porcelain", "--untracked-files=no"]) {
            Some(s) if !s.is_empty() => format!("{c}-dirty"),
            _ => c,
        },
    }
}

/// The command line that produced the results: the program and every absolute path without
/// their directories (those name the machine that ran it, not the repository).
pub fn command() -> String {
    let local = |a: String| {
        let p = Path::new(&a);
        match p.file_name() {
            Some(n) if p.is_absolute() || p.parent().is_some_and(|d| d.starts_with("..")) => {
                n.to_string_lossy().into_owned()
            }
            _ => a,
        }
    };
    let mut args = std::env::args();
    let prog = args.next().unwrap_or_default();
    let prog = Path::new(&prog)
        .file_name()
        .map_or(prog.clone(), |n| n.to_string_lossy().into_owned());
    std::iter::once(prog)
        .chain(args.map(local))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The GPU's name, or the CPU's model name and core count.
pub fn device_name(dev: &Device) -> String {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        return d
            .cuda_stream()
            .context()
            .name()
            .unwrap_or_else(|e| format!("CUDA device ({e})"));
    }
    let _ = dev;
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{model} ({cores} threads)")
}
