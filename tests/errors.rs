//! Every invalid input must come back as a `candle::Error` naming the argument; never a panic,
//! never an output.

use candle::{DType, Device, Tensor};
use candle_flash::{flash_attn, flash_attn_alibi, flash_attn_varlen, naive_attention, FlashAttn};

fn t(shape: &[usize], dtype: DType) -> Tensor {
    Tensor::zeros(shape, dtype, &Device::Cpu).unwrap()
}

fn f32t(shape: &[usize]) -> Tensor {
    t(shape, DType::F32)
}

/// Asserts the result is an error whose message mentions every word of `needles`.
fn expect_err<T: std::fmt::Debug>(r: candle::Result<T>, needles: &[&str]) {
    let e = r.expect_err("invalid input must be refused").to_string();
    for n in needles {
        assert!(e.contains(n), "error {e:?} should mention {n:?}");
    }
}

#[test]
fn rank_must_be_four() {
    let good = f32t(&[1, 4, 2, 8]);
    expect_err(
        flash_attn(&f32t(&[4, 2, 8]), &good, &good, 1.0, false),
        &["q", "rank 4"],
    );
    expect_err(
        flash_attn(&good, &f32t(&[1, 1, 4, 2, 8]), &good, 1.0, false),
        &["k", "rank 4"],
    );
    expect_err(
        flash_attn(&good, &good, &f32t(&[8]), 1.0, false),
        &["v", "rank 4"],
    );
}

#[test]
fn dtypes_must_match_and_be_supported() {
    let q = f32t(&[1, 4, 2, 8]);
    expect_err(
        flash_attn(&q, &t(&[1, 4, 2, 8], DType::F16), &q, 1.0, false),
        &["k", "dtype"],
    );
    expect_err(
        flash_attn(&q, &q, &t(&[1, 4, 2, 8], DType::BF16), 1.0, false),
        &["v", "dtype"],
    );
    let qd = t(&[1, 4, 2, 8], DType::F64);
    expect_err(flash_attn(&qd, &qd, &qd, 1.0, false), &["q", "F64"]);
    let qu = t(&[1, 4, 2, 8], DType::U32);
    expect_err(flash_attn(&qu, &qu, &qu, 1.0, false), &["q", "dtype"]);
}

#[test]
fn shapes_must_agree() {
    let q = f32t(&[2, 4, 6, 8]);
    expect_err(
        flash_attn(&q, &f32t(&[1, 4, 2, 8]), &f32t(&[1, 4, 2, 8]), 1.0, false),
        &["batch"],
    );
    expect_err(
        flash_attn(&q, &f32t(&[2, 4, 2, 16]), &f32t(&[2, 4, 2, 16]), 1.0, false),
        &["head_dim"],
    );
    expect_err(
        flash_attn(&q, &f32t(&[2, 4, 2, 8]), &f32t(&[2, 5, 2, 8]), 1.0, false),
        &["k", "v", "shape"],
    );
    expect_err(
        flash_attn(&q, &f32t(&[2, 4, 4, 8]), &f32t(&[2, 4, 4, 8]), 1.0, false),
        &["heads", "multiple"],
    );
    expect_err(
        flash_attn(&q, &f32t(&[2, 4, 0, 8]), &f32t(&[2, 4, 0, 8]), 1.0, false),
        &["0 kv heads"],
    );
    let big = f32t(&[1, 2, 1, 520]);
    expect_err(
        flash_attn(&big, &big, &big, 1.0, false),
        &["head_dim", "520"],
    );
    let zero = f32t(&[1, 2, 1, 0]);
    expect_err(flash_attn(&zero, &zero, &zero, 1.0, false), &["head_dim"]);
}

#[test]
fn options_are_checked() {
    let q = f32t(&[2, 4, 6, 8]);
    let kv = f32t(&[2, 4, 2, 8]);
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
        flash_attn_alibi(&q, &kv, &kv, &f32t(&[5]), 1.0, false),
        &["alibi_slopes", "shape"],
    );
    expect_err(
        flash_attn_alibi(&q, &kv, &kv, &f32t(&[3, 6]), 1.0, false),
        &["alibi_slopes", "shape"],
    );
    expect_err(
        flash_attn_alibi(&q, &kv, &kv, &t(&[6], DType::F16), 1.0, false),
        &["alibi_slopes", "f32"],
    );
    // The naive reference refuses the same inputs.
    expect_err(
        naive_attention(
            &q,
            &f32t(&[2, 4, 4, 8]),
            &f32t(&[2, 4, 4, 8]),
            &FlashAttn::new(1.0),
        ),
        &["heads"],
    );
}

#[test]
fn seqlens_are_checked() {
    let dev = Device::Cpu;
    let q = f32t(&[10, 4, 8]);
    let k = f32t(&[12, 2, 8]);
    let cu = |v: &[u32]| Tensor::new(v, &dev).unwrap();
    let ok_q = cu(&[0, 4, 10]);
    let ok_k = cu(&[0, 5, 12]);
    assert!(flash_attn_varlen(&q, &k, &k, &ok_q, &ok_k, 6, 7, 1.0, true).is_ok());
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
        flash_attn_varlen(&q, &k, &k, &ok_q, &cu(&[0, 12]), 6, 12, 1.0, true),
        &["entries"],
    );
    expect_err(
        flash_attn_varlen(&q, &k, &k, &ok_q, &ok_k, 5, 7, 1.0, true),
        &["seqlens_q", "max_seqlen"],
    );
    expect_err(
        flash_attn_varlen(
            &q,
            &k,
            &k,
            &ok_q.to_dtype(DType::I64).unwrap(),
            &ok_k,
            6,
            7,
            1.0,
            true,
        ),
        &["seqlens_q", "u32"],
    );
    expect_err(
        flash_attn_varlen(&q, &k, &k, &cu(&[]), &ok_k, 6, 7, 1.0, true),
        &["seqlens_q", "batch + 1"],
    );
    expect_err(
        flash_attn_varlen(&f32t(&[1, 10, 4, 8]), &k, &k, &ok_q, &ok_k, 6, 7, 1.0, true),
        &["q", "rank 3"],
    );
}
