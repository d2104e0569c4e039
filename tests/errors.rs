//! Every invalid input must come back as a `candle::Error` naming the argument; never a panic,
//! never an output, never a launch. Each property runs on the CPU and on the GPU (validation is
//! the same code, but the tensors' device is not).

#[macro_use]
mod common;

use candle::{DType, Result, Tensor};
use candle_flash::{flash_attn, flash_attn_alibi, flash_attn_varlen, naive_attention, FlashAttn};
use common::{empty, Target};

/// f32 zeros of `shape` on the target.
fn z(t: &Target, shape: &[usize]) -> Tensor {
    zd(t, shape, DType::F32)
}

/// Zeros of `shape` on the target (an empty view where the shape holds no element).
fn zd(t: &Target, shape: &[usize], dtype: DType) -> Tensor {
    if shape.iter().product::<usize>() == 0 {
        return empty(shape, dtype, &t.dev).unwrap();
    }
    Tensor::zeros(shape, dtype, &t.dev).unwrap()
}

/// Asserts the result is an error whose message mentions every word of `needles`.
fn expect_err<T: std::fmt::Debug>(r: Result<T>, needles: &[&str]) {
    let e = r.expect_err("invalid input must be refused").to_string();
    for n in needles {
        assert!(e.contains(n), "error {e:?} should mention {n:?}");
    }
}

fn rank_must_be_four(t: &Target) -> Result<()> {
    let good = z(t, &[1, 4, 2, 8]);
    expect_err(
        flash_attn(&z(t, &[4, 2, 8]), &good, &good, 1.0, false),
        &["q", "rank 4"],
    );
    expect_err(
        flash_attn(&good, &z(t, &[1, 1, 4, 2, 8]), &good, 1.0, false),
        &["k", "rank 4"],
    );
    expect_err(
        flash_attn(&good, &good, &z(t, &[8]), 1.0, false),
        &["v", "rank 4"],
    );
    Ok(())
}
test_device!(rank_must_be_four, Once);

fn dtypes_must_match_and_be_supported(t: &Target) -> Result<()> {
    let q = z(t, &[1, 4, 2, 8]);
    expect_err(
        flash_attn(&q, &zd(t, &[1, 4, 2, 8], DType::F16), &q, 1.0, false),
        &["k", "dtype"],
    );
    expect_err(
        flash_attn(&q, &q, &zd(t, &[1, 4, 2, 8], DType::BF16), 1.0, false),
        &["v", "dtype"],
    );
    let qd = zd(t, &[1, 4, 2, 8], DType::F64);
    expect_err(flash_attn(&qd, &qd, &qd, 1.0, false), &["q", "F64"]);
    let qu = zd(t, &[1, 4, 2, 8], DType::U32);
    expect_err(flash_attn(&qu, &qu, &qu, 1.0, false), &["q", "dtype"]);
    Ok(())
}
test_device!(dtypes_must_match_and_be_supported, Once);

fn shapes_must_agree(t: &Target) -> Result<()> {
    let q = z(t, &[2, 4, 6, 8]);
    expect_err(
        flash_attn(&q, &z(t, &[1, 4, 2, 8]), &z(t, &[1, 4, 2, 8]), 1.0, false),
        &["batch"],
    );
    expect_err(
        flash_attn(&q, &z(t, &[2, 4, 2, 16]), &z(t, &[2, 4, 2, 16]), 1.0, false),
        &["head_dim"],
    );
    expect_err(
        flash_attn(&q, &z(t, &[2, 4, 2, 8]), &z(t, &[2, 5, 2, 8]), 1.0, false),
        &["k", "v", "shape"],
    );
    expect_err(
        flash_attn(&q, &z(t, &[2, 4, 4, 8]), &z(t, &[2, 4, 4, 8]), 1.0, false),
        &["heads", "multiple"],
    );
    expect_err(
        flash_attn(&q, &z(t, &[2, 4, 0, 8]), &z(t, &[2, 4, 0, 8]), 1.0, false),
        &["0 kv heads"],
    );
    let big = z(t, &[1, 2, 1, 520]);
    expect_err(
        flash_attn(&big, &big, &big, 1.0, false),
        &["head_dim", "520"],
    );
    let zero = z(t, &[1, 2, 1, 0]);
    expect_err(flash_attn(&zero, &zero, &zero, 1.0, false), &["head_dim"]);
    Ok(())
}
test_device!(shapes_must_agree, Once);

fn options_are_checked(t: &Target) -> Result<()> {
    let q = z(t, &[2, 4, 6, 8]);
    let kv = z(t, &[2, 4, 2, 8]);
    expect_err(
        flash_attn(&q, &kv, &kv, f32::NAN, false),
        &["softmax_scale"],
    );
    expect_err(
        flash_attn(&q, &kv, &kv, f32::INFINITY, false),
        &["softmax_scale"],
    );
    expect_err(
        FlashAttn::new(1.0).softcap(-1.0).forward(&q, &kv, &kv),
        &["softcap"],
    );
    expect_err(
        FlashAttn::new(1.0).softcap(f32::NAN).forward(&q, &kv, &kv),
        &["softcap"],
    );
    expect_err(
        flash_attn_alibi(&q, &kv, &kv, &z(t, &[5]), 1.0, false),
        &["alibi_slopes", "shape"],
    );
    expect_err(
        flash_attn_alibi(&q, &kv, &kv, &z(t, &[3, 6]), 1.0, false),
        &["alibi_slopes", "shape"],
    );
    expect_err(
        flash_attn_alibi(&q, &kv, &kv, &zd(t, &[6], DType::F16), 1.0, false),
        &["alibi_slopes", "f32"],
    );
    // The naive reference refuses the same inputs.
    expect_err(
        naive_attention(
            &q,
            &z(t, &[2, 4, 4, 8]),
            &z(t, &[2, 4, 4, 8]),
            &FlashAttn::new(1.0),
        ),
        &["heads"],
    );
    Ok(())
}
test_device!(options_are_checked, Once);

/// Varlen offsets: dtype, shape and device everywhere; on the CPU their values too. On CUDA the
/// library never reads them back (no host synchronisation per call; the kernels clamp what they
/// say, as FlashAttention's do), so values are not errors there.
fn seqlens_are_checked(t: &Target) -> Result<()> {
    let q = z(t, &[10, 4, 8]);
    let k = z(t, &[12, 2, 8]);
    let cu = |v: &[u32]| Tensor::new(v, &t.dev).unwrap();
    let ok_q = cu(&[0, 4, 10]);
    let ok_k = cu(&[0, 5, 12]);
    assert!(flash_attn_varlen(&q, &k, &k, &ok_q, &ok_k, 6, 7, 1.0, true).is_ok());
    expect_err(
        flash_attn_varlen(&q, &k, &k, &ok_q, &cu(&[0, 12]), 6, 12, 1.0, true),
        &["entries"],
    );
    expect_err(
        flash_attn_varlen(
            &q,
            &k,
            &k,
            &ok_q.to_dtype(DType::I64)?,
            &ok_k,
            6,
            7,
            1.0,
            true,
        ),
        &["seqlens_q", "u32"],
    );
    expect_err(
        flash_attn_varlen(
            &q,
            &k,
            &k,
            &empty(&[0], DType::U32, &t.dev)?,
            &ok_k,
            6,
            7,
            1.0,
            true,
        ),
        &["seqlens_q", "batch + 1"],
    );
    expect_err(
        flash_attn_varlen(&z(t, &[1, 10, 4, 8]), &k, &k, &ok_q, &ok_k, 6, 7, 1.0, true),
        &["q", "rank 3"],
    );
    if t.is_cuda() {
        return Ok(());
    }
    expect_err(
        flash_attn_varlen(&q, &k, &k, &cu(&[1, 4, 10]), &ok_k, 6, 7, 1.0, true),
        &["seqlens_q", "start at 0"],
    );
    expect_err(
        flash_attn_varlen(
            &q,
            &k,
            &k,
            &cu(&[0, 6, 4, 10]),
            &cu(&[0, 1, 2, 12]),
            6,
            10,
            1.0,
            true,
        ),
        &["seqlens_q", "non-decreasing"],
    );
    expect_err(
        flash_attn_varlen(&q, &k, &k, &cu(&[0, 4, 9]), &ok_k, 6, 7, 1.0, true),
        &["seqlens_q", "10 tokens"],
    );
    expect_err(
        flash_attn_varlen(&q, &k, &k, &ok_q, &ok_k, 5, 7, 1.0, true),
        &["seqlens_q", "max_seqlen"],
    );
    Ok(())
}
test_device!(seqlens_are_checked, Once);

/// Operands, ALiBi slopes and sequence offsets on another device than q are refused, naming the
/// argument, before anything runs.
#[cfg(feature = "cuda")]
fn devices_must_match(t: &Target) -> Result<()> {
    let cpu = Target::cpu();
    let (q, kv) = (z(t, &[2, 4, 6, 8]), z(t, &[2, 4, 2, 8]));
    let (q_cpu, kv_cpu) = (z(&cpu, &[2, 4, 6, 8]), z(&cpu, &[2, 4, 2, 8]));
    expect_err(flash_attn(&q, &kv_cpu, &kv, 1.0, false), &["k", "is on"]);
    expect_err(flash_attn(&q, &kv, &kv_cpu, 1.0, false), &["v", "is on"]);
    expect_err(flash_attn(&q_cpu, &kv, &kv, 1.0, false), &["k", "is on"]);
    let slopes = Tensor::new(&[0.5f32; 6], &candle::Device::Cpu)?;
    expect_err(
        flash_attn_alibi(&q, &kv, &kv, &slopes, 1.0, false),
        &["alibi_slopes", "is on"],
    );
    let (q3, k3) = (z(t, &[10, 4, 8]), z(t, &[12, 2, 8]));
    let ok_q = Tensor::new(&[0u32, 4, 10], &t.dev)?;
    let ok_k = Tensor::new(&[0u32, 5, 12], &t.dev)?;
    let host_q = Tensor::new(&[0u32, 4, 10], &candle::Device::Cpu)?;
    let host_k = Tensor::new(&[0u32, 5, 12], &candle::Device::Cpu)?;
    expect_err(
        flash_attn_varlen(&q3, &k3, &k3, &host_q, &ok_k, 6, 7, 1.0, true),
        &["seqlens_q", "is on"],
    );
    expect_err(
        flash_attn_varlen(&q3, &k3, &k3, &ok_q, &host_k, 6, 7, 1.0, true),
        &["seqlens_k", "is on"],
    );
    Ok(())
}
test_cuda!(devices_must_match, Once);
