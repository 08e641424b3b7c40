//! GGUF dequantization against gguf-py and MLX's GGUF loader: tests/fixtures/gguf/blocks.gguf
//! holds one tensor per ggml type, blocks.json what `gguf.quants.dequantize` and `mx.load` give
//! for them (scripts/oracle/make_gguf_fixtures.py). Every value must match bit for bit.

use std::path::PathBuf;

use oxlm_convert::gguf::dequantize::{dequantize, to_mlx_affine};
use oxlm_convert::gguf::GgufFile;
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf")
}

fn golden() -> Value {
    let text = std::fs::read_to_string(fixtures().join("blocks.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn numbers(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn dequantize_matches_gguf_py_for_every_type() {
    let gguf = GgufFile::open(&fixtures().join("blocks.gguf")).unwrap();
    let golden = golden();
    let expected = golden["dequantize"].as_object().unwrap();
    assert_eq!(gguf.tensors.len(), 13);
    assert_eq!(expected.len(), gguf.tensors.len());
    for tensor in &gguf.tensors {
        let want = &expected[&tensor.name];
        assert_eq!(want["type"], tensor.ggml_type.name(), "{}", tensor.name);
        let shape: Vec<usize> = numbers(&want["shape"])
            .iter()
            .map(|&d| d as usize)
            .collect();
        assert_eq!(shape, tensor.shape, "{}", tensor.name);
        let got: Vec<u64> = dequantize(tensor, gguf.tensor_data(tensor))
            .unwrap()
            .iter()
            .map(|v| u64::from(v.to_bits()))
            .collect();
        let want = numbers(&want["values"]);
        let first_diff = got.iter().zip(&want).position(|(a, b)| a != b);
        assert!(
            got.len() == want.len() && first_diff.is_none(),
            "{}: {} values, want {}; first difference at {first_diff:?}",
            tensor.name,
            got.len(),
            want.len()
        );
    }
}

#[test]
fn mlx_affine_matches_mx_load() {
    let gguf = GgufFile::open(&fixtures().join("blocks.gguf")).unwrap();
    let golden = golden();
    let expected = golden["mlx_load"].as_object().unwrap();
    let mut checked = 0;
    for tensor in &gguf.tensors {
        let affine = to_mlx_affine(tensor, gguf.tensor_data(tensor)).unwrap();
        let Some(want) = expected.get(&tensor.name) else {
            assert_eq!(affine, None, "{}", tensor.name);
            continue;
        };
        let affine = affine.unwrap();
        let name = &tensor.name;
        assert_eq!(
            u64::from(affine.bits),
            want["bits"].as_u64().unwrap(),
            "{name}"
        );
        let words: Vec<u64> = affine.packed.iter().map(|&w| w.into()).collect();
        assert_eq!(words, numbers(&want["weight"]), "{name} weight");
        let bits = |v: &[half::f16]| v.iter().map(|x| u64::from(x.to_bits())).collect::<Vec<_>>();
        assert_eq!(
            bits(&affine.scales),
            numbers(&want["scales"]),
            "{name} scales"
        );
        assert_eq!(
            bits(&affine.biases),
            numbers(&want["biases"]),
            "{name} biases"
        );
        checked += 1;
    }
    assert_eq!(checked, 3);
}

/// The affine triple means the same values as ggml's own formula, rounding aside: scale·q + bias
/// is one more rounding than ggml's d·(q − 8) for Q4_0 and Q8_0.
#[test]
fn mlx_affine_values_are_the_dequantized_ones() {
    let gguf = GgufFile::open(&fixtures().join("blocks.gguf")).unwrap();
    for name in ["q4_0.weight", "q4_1.weight", "q8_0.weight"] {
        let tensor = gguf.tensor(name).unwrap();
        let data = gguf.tensor_data(tensor);
        let floats = dequantize(tensor, data).unwrap();
        let affine = to_mlx_affine(tensor, data).unwrap().unwrap();
        let bits = affine.bits as usize;
        for (j, &want) in floats.iter().enumerate() {
            let q = (affine.packed[j * bits / 32] >> (j * bits % 32)) & ((1 << bits) - 1);
            let group = j / 32;
            let got = affine.scales[group].to_f32() * q as f32 + affine.biases[group].to_f32();
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{name}[{j}]: {got} vs {want}"
            );
        }
    }
}

/// A tensor whose rows end inside a block is refused when the file is opened, naming it.
#[test]
fn a_row_that_is_not_whole_blocks_is_an_error() {
    let mut bytes = std::fs::read(fixtures().join("blocks.gguf")).unwrap();
    let name = b"q4_0.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    // After the name: the dimension count (u32), then the innermost dimension (u64), 64.
    assert_eq!(bytes[at + 4..at + 12], 64u64.to_le_bytes());
    bytes[at + 4..at + 12].copy_from_slice(&48u64.to_le_bytes());
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &bytes).unwrap();
    let err = GgufFile::open(file.path()).err().unwrap().to_string();
    assert!(
        err.contains(
            "tensor `q4_0.weight` of shape [4, 48] is not whole blocks of 32 Q4_0 elements"
        ),
        "{err}"
    );
}
