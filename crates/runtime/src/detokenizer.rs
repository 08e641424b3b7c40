//! Streaming detokenization as mlx-lm 0.32.2 does it (mlx_lm/tokenizer_utils.py): text is released token by
//! token, never ending in a partial UTF-8 character, and concatenates to what mlx-lm's `stream_generate` prints.
//!
//! mlx-lm picks one of three detokenizers from tokenizer.json's decoder ([`DetokenizerKind`]):
//! - SPM (`SPMStreamingDetokenizer`): token strings with `▁` as space and `<0xNN>` byte tokens, flushed
//!   whenever the bytes so far decode without a trailing U+FFFD; with `trim_space` the first space of the output
//!   is dropped (what the decoder's `Strip` does).
//! - BPE (`BPEStreamingDetokenizer`): byte-level token strings mapped back through GPT-2's byte table, flushed
//!   the same way, except that a lone space token waits for the next token. A space at the very start of the
//!   output is dropped, so the output differs from `decode` there (mlx-lm prints "Paris" where `decode` gives
//!   " Paris"). mlx-lm's byte lookup also treats the byte 0 as absent (`if res:`), so a NUL byte comes out as
//!   "Ā" while text is streaming; this is reproduced.
//! - Naive (`NaiveStreamingDetokenizer`): re-decodes the tokens of the current line with the tokenizer, holding
//!   back trailing U+FFFD and (when decoding cleans up spaces) a trailing space, and fixes a line once it ends in
//!   a newline.
//!
//! Apart from those documented differences, the concatenated output equals `Tokenizer::decode(ids, false)`.
//! Special tokens are not skipped: mlx-lm's generation loop stops before adding an EOS token, and so should the
//! caller.

use std::sync::{Arc, OnceLock};

use crate::tokenizer::{DetokenizerKind, Result, Tokenizer};

const REPLACEMENT: char = '\u{FFFD}';

/// Token strings as mlx-lm's detokenizers see them (`convert_ids_to_tokens` over the whole vocabulary).
#[derive(Debug)]
pub(crate) enum TokenMap {
    /// SPM: the bytes of each token (`<0xNN>` is the byte NN, `▁` kept as is).
    Spm(Vec<Box<[u8]>>),
    /// BPE: the byte-level token strings.
    Bpe(Vec<Box<str>>),
    Naive,
}

impl TokenMap {
    fn build(tokenizer: &Tokenizer) -> Self {
        let tokens = || {
            (0..tokenizer.vocab_size() as u32)
                .map(|id| tokenizer.id_to_token(id).unwrap_or_default())
        };
        match tokenizer.detokenizer_kind() {
            DetokenizerKind::Spm { .. } => {
                Self::Spm(tokens().map(|t| spm_token_bytes(&t)).collect())
            }
            DetokenizerKind::Bpe => Self::Bpe(tokens().map(String::into_boxed_str).collect()),
            DetokenizerKind::Naive => Self::Naive,
        }
    }
}

/// Lazily built, shared by every detokenizer of a tokenizer (mlx-lm builds the map once per tokenizer).
pub(crate) type SharedTokenMap = Arc<OnceLock<TokenMap>>;

fn spm_token_bytes(token: &str) -> Box<[u8]> {
    // "<0x0A>" is the byte 0x0A (mlx-lm reads t[3:5] as hex)
    if let Some(hex) = token.strip_prefix("<0x").and_then(|rest| rest.get(..2)) {
        if let Ok(byte) = u8::from_str_radix(hex, 16) {
            return Box::new([byte]);
        }
    }
    token.as_bytes().into()
}

/// GPT-2's unicode-to-byte table (mlx-lm `_byte_decoder`): printable Latin-1 stands for itself, the other bytes
/// are mapped to U+0100 onwards in order.
fn byte_of(c: char) -> Option<u8> {
    static TABLE: OnceLock<[Option<u8>; 324]> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut table = [None; 324];
        let printable = |b: u32| {
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
        };
        let mut n = 0;
        for b in 0..=255u32 {
            if printable(b) {
                table[b as usize] = Some(b as u8);
            } else {
                table[256 + n] = Some(b as u8);
                n += 1;
            }
        }
        table
    });
    table.get(c as usize).copied().flatten()
}

/// mlx-lm `BPEStreamingDetokenizer._decode_bytes`, including its treatment of byte 0 as unmapped.
fn decode_bpe_streaming(seq: &str) -> String {
    let mut bytes = Vec::with_capacity(seq.len());
    for c in seq.chars() {
        match byte_of(c) {
            Some(b) if b != 0 => bytes.push(b),
            _ => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// mlx-lm `BPEStreamingDetokenizer.finalize`: every character through the byte table.
fn decode_bpe_final(seq: &str) -> String {
    let mut bytes = Vec::with_capacity(seq.len());
    for c in seq.chars() {
        match byte_of(c) {
            Some(b) => bytes.push(b),
            // mlx-lm raises KeyError here; keep the character instead.
            None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

enum State {
    Spm {
        trim_space: bool,
        unflushed: Vec<u8>,
    },
    Bpe {
        unflushed: String,
    },
    Naive {
        clean_spaces: bool,
        /// Finished lines.
        text: String,
        /// Tokens of the current line and their held-back decoding.
        current: Vec<u32>,
        current_text: String,
        /// Characters of `text + current_text` already returned (mlx-lm `offset`).
        offset: usize,
    },
}

/// A per-request streaming detokenizer; see the module docs for the exact semantics.
pub struct StreamingDetokenizer {
    tokenizer: Tokenizer,
    state: State,
    tokens: Vec<u32>,
    /// Whether any text has been released (the SPM/BPE `if not self.text` checks).
    emitted: bool,
}

impl StreamingDetokenizer {
    pub fn new(tokenizer: &Tokenizer) -> Result<Self> {
        let state = match tokenizer.detokenizer_kind() {
            DetokenizerKind::Spm { trim_space } => State::Spm {
                trim_space,
                unflushed: Vec::new(),
            },
            DetokenizerKind::Bpe => State::Bpe {
                unflushed: String::new(),
            },
            DetokenizerKind::Naive => {
                // mlx-lm probes whether decoding removes the space in " ,"
                let probe = tokenizer.encode("a ,b", false)?;
                State::Naive {
                    clean_spaces: !tokenizer.decode(&probe, false)?.contains(" ,"),
                    text: String::new(),
                    current: Vec::new(),
                    current_text: String::new(),
                    offset: 0,
                }
            }
        };
        Ok(Self {
            tokenizer: tokenizer.clone(),
            state,
            tokens: Vec::new(),
            emitted: false,
        })
    }

    /// This detokenizer for output that continues text already written (a prefilled reply):
    /// its first space is kept, as a space inside the text is.
    pub fn continuing(mut self) -> Self {
        self.emitted = true;
        self
    }

    /// All ids pushed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Adds one token and returns the text it finalised (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.tokens.push(id);
        if let State::Naive { current, .. } = &mut self.state {
            current.push(id);
            return self.naive_segment();
        }
        let out = match (&mut self.state, self.tokenizer.token_map()) {
            (
                State::Spm {
                    trim_space,
                    unflushed,
                },
                TokenMap::Spm(map),
            ) => {
                unflushed.extend_from_slice(map.get(id as usize).map_or(&[][..], |b| &b[..]));
                let trim = *trim_space && !self.emitted;
                spm_flush(unflushed, trim, false)
            }
            (State::Bpe { unflushed }, TokenMap::Bpe(map)) => {
                // mlx-lm's fallback for ids past the vocabulary (padded embeddings)
                let token = map.get(id as usize).map_or("!", |t| &t[..]);
                unflushed.push_str(token);
                let text = decode_bpe_streaming(unflushed);
                let mut chars = token.chars();
                let lone_space = matches!((chars.next(), chars.next()), (Some(c), None) if byte_of(c) == Some(b' '));
                if text.ends_with(REPLACEMENT) || lone_space {
                    String::new()
                } else {
                    unflushed.clear();
                    trim_leading_space(text, !self.emitted)
                }
            }
            _ => unreachable!("token map kind follows the detokenizer kind"),
        };
        self.emitted |= !out.is_empty();
        Ok(out)
    }

    /// Flushes whatever is held back (incomplete characters are emitted as U+FFFD).
    pub fn finish(&mut self) -> Result<String> {
        let out = match &mut self.state {
            State::Spm {
                trim_space,
                unflushed,
            } => spm_flush(unflushed, *trim_space && !self.emitted, true),
            State::Bpe { unflushed } => {
                let text = decode_bpe_final(unflushed);
                unflushed.clear();
                trim_leading_space(text, !self.emitted)
            }
            State::Naive {
                text,
                current,
                current_text,
                ..
            } => {
                text.push_str(&self.tokenizer.decode(current, false)?);
                current.clear();
                current_text.clear();
                self.naive_segment()?
            }
        };
        self.emitted |= !out.is_empty();
        Ok(out)
    }

    /// mlx-lm `NaiveStreamingDetokenizer.text` followed by `last_segment`.
    fn naive_segment(&mut self) -> Result<String> {
        let State::Naive {
            clean_spaces,
            text,
            current,
            current_text,
            offset,
        } = &mut self.state
        else {
            unreachable!("only called for the naive detokenizer")
        };
        if !current.is_empty() {
            *current_text = self.tokenizer.decode(current, false)?;
            if current_text.ends_with(REPLACEMENT) {
                // An incomplete character can decode to several replacements.
                current_text.truncate(current_text.trim_end_matches(REPLACEMENT).len());
            } else if *clean_spaces && current_text.ends_with(' ') {
                current_text.pop();
            }
        }
        if current_text.ends_with('\n') {
            text.push_str(current_text);
            current.clear();
            current_text.clear();
        }
        let full = text.chars().chain(current_text.chars());
        let segment: String = full.clone().skip(*offset).collect();
        *offset = full.count();
        Ok(segment)
    }
}

/// mlx-lm `SPMStreamingDetokenizer._try_flush`.
fn spm_flush(unflushed: &mut Vec<u8>, trim: bool, force: bool) -> String {
    let text = String::from_utf8_lossy(unflushed).replace('\u{2581}', " ");
    if !force && text.ends_with(REPLACEMENT) {
        return String::new();
    }
    unflushed.clear();
    trim_leading_space(text, trim)
}

/// Drops one leading space when nothing has been emitted yet (mlx-lm `_maybe_trim_space`).
fn trim_leading_space(text: String, at_start: bool) -> String {
    match text.strip_prefix(' ') {
        Some(rest) if at_start => rest.to_owned(),
        _ => text,
    }
}

impl Tokenizer {
    /// A fresh streaming detokenizer (mlx-lm `TokenizerWrapper.detokenizer`).
    pub fn detokenizer(&self) -> Result<StreamingDetokenizer> {
        StreamingDetokenizer::new(self)
    }

    fn token_map(&self) -> &TokenMap {
        self.token_map_cell().get_or_init(|| TokenMap::build(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_matches_gpt2() {
        assert_eq!(byte_of('Ġ'), Some(b' '));
        assert_eq!(byte_of('Ċ'), Some(b'\n'));
        assert_eq!(byte_of('Ā'), Some(0));
        assert_eq!(byte_of('a'), Some(b'a'));
        assert_eq!(byte_of('é'), Some(0xE9));
        assert_eq!(byte_of('ł'), Some(0xA0));
        assert_eq!(byte_of('Ń'), Some(0xAD));
        assert_eq!(byte_of('ń'), None);
        // "Ã©" is the byte-level spelling of "é"
        assert_eq!(decode_bpe_streaming("Ã©"), "é");
        assert_eq!(decode_bpe_streaming("Ã"), "\u{FFFD}");
    }

    #[test]
    fn spm_bytes_of_tokens() {
        assert_eq!(&*spm_token_bytes("<0x0A>"), b"\n");
        assert_eq!(&*spm_token_bytes("\u{2581}hi"), "\u{2581}hi".as_bytes());
        assert_eq!(&*spm_token_bytes("<0xZZ>"), b"<0xZZ>");
    }
}
