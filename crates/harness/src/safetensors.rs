//! The safetensors layout, taken apart and put back together by hand: the harness writes files
//! no library would (inconsistent headers), so it depends on none.

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

/// A safetensors file: an 8-byte little-endian header length, the header's JSON (tensor name
/// → dtype, shape, data offsets), then the data.
pub struct Safetensors {
    pub bytes: Vec<u8>,
    pub header: Map<String, Value>,
    /// As stored, padding included.
    pub header_length: usize,
}

impl Safetensors {
    pub fn parse(bytes: Vec<u8>) -> Result<Safetensors> {
        let length = bytes.get(..8).context("shorter than a header length")?;
        let header_length = usize::try_from(u64::from_le_bytes(length.try_into()?))?;
        let text = bytes
            .get(8..8 + header_length)
            .context("shorter than its header")?;
        let header = match serde_json::from_slice(text)? {
            Value::Object(map) => map,
            _ => bail!("the header is not an object"),
        };
        Ok(Safetensors {
            bytes,
            header,
            header_length,
        })
    }

    pub fn data_start(&self) -> usize {
        8 + self.header_length
    }

    pub fn data(&self) -> &[u8] {
        &self.bytes[self.data_start()..]
    }

    pub fn tensor_names(&self) -> Vec<String> {
        self.header
            .keys()
            .filter(|k| *k != "__metadata__")
            .cloned()
            .collect()
    }

    /// A tensor's dtype, shape and bytes.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let entry = &self.header[name];
        let offsets: Vec<usize> = entry["data_offsets"]
            .as_array()
            .context("data_offsets")?
            .iter()
            .filter_map(|o| o.as_u64().map(|o| o as usize))
            .collect();
        let data = self
            .data()
            .get(offsets[0]..offsets[1])
            .with_context(|| format!("{name}: offsets beyond the data"))?;
        Ok(Tensor {
            dtype: entry["dtype"].as_str().context("dtype")?.to_owned(),
            shape: entry["shape"]
                .as_array()
                .context("shape")?
                .iter()
                .filter_map(Value::as_u64)
                .collect(),
            data: data.to_vec(),
        })
    }
}

pub struct Tensor {
    pub dtype: String,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// A file of `header` (padded with spaces to a multiple of 8, as writers do) and `data`.
pub fn with_header(header: &Value, data: &[u8]) -> Vec<u8> {
    let mut text = header.to_string().into_bytes();
    text.resize(text.len().next_multiple_of(8), b' ');
    [&(text.len() as u64).to_le_bytes(), text.as_slice(), data].concat()
}

/// A file of `tensors`, laid out in order.
pub fn serialize(tensors: &[(String, Tensor)]) -> Vec<u8> {
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "mlx"}));
    let mut data = Vec::new();
    for (name, tensor) in tensors {
        let start = data.len();
        data.extend_from_slice(&tensor.data);
        header.insert(
            name.clone(),
            json!({"dtype": tensor.dtype, "shape": tensor.shape,
                   "data_offsets": [start, data.len()]}),
        );
    }
    with_header(&Value::Object(header), &data)
}
