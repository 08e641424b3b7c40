//! Constrained decoding: a JSON schema, a Lark grammar or a regular expression turned into the
//! set of tokens each step may take, so that what is generated always parses. The grammar
//! engine is llguidance (the one llama.cpp, vLLM and SGLang use): it walks the tokenizer's
//! vocabulary as a trie against an Earley parser, about 50 µs a token.

use std::fmt;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use serde_json::Value;
use thiserror::Error;
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone, Error)]
pub enum ConstraintError {
    #[error("the tokenizer's vocabulary cannot be read for constrained decoding: {0}")]
    Vocabulary(String),
    /// The grammar or schema cannot be compiled: invalid, or asks for what the engine cannot
    /// enforce (the message names it).
    #[error("{0}")]
    Unsupported(String),
    #[error("constrained decoding failed: {0}")]
    Matcher(String),
}

/// What generated text must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// JSON valid under a JSON Schema (`{}` or `{"type": "object"}` for any object).
    JsonSchema(Value),
    /// llguidance's Lark dialect: `%json {schema}` embeds a schema, `<name>` a special token.
    Lark(String),
    /// A regular expression the whole output matches.
    Regex(String),
}

/// Compiles grammars against one tokenizer's vocabulary; made once per model, shared by its
/// requests.
pub struct Grammars {
    factory: ParserFactory,
}

impl fmt::Debug for Grammars {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

impl Grammars {
    /// The vocabulary of `tokenizer`, padded to the model's `vocab_size` logits (padding ids
    /// are never allowed); `eos_ids` end generation once the grammar is complete.
    pub fn new(
        tokenizer: &Tokenizer,
        eos_ids: &[u32],
        vocab_size: usize,
    ) -> Result<Self, ConstraintError> {
        let vocabulary = |e: &dyn fmt::Display| ConstraintError::Vocabulary(e.to_string());
        let json = tokenizer.to_json().map_err(|e| vocabulary(&e))?;
        let json: Value = serde_json::from_str(&json).map_err(|e| vocabulary(&e))?;
        let mut words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| vocabulary(&e))?;
        words.resize(words.len().max(vocab_size), Vec::new());
        let Some(&first_eos) = eos_ids.first() else {
            return Err(vocabulary(&"the model has no end-of-sequence token"));
        };
        let info = TokRxInfo::new(words.len() as u32, first_eos);
        if let Some(&eos) = eos_ids.iter().find(|&&id| id >= info.vocab_size) {
            return Err(vocabulary(&format!(
                "end-of-sequence id {eos} is outside the vocabulary"
            )));
        }
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos_ids);
        let env: TokEnv = Arc::new(Vocabulary {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| vocabulary(&e))?;
        // Errors come back to the caller; nothing for the engine to print.
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A fresh constraint for one generation, or why `grammar` cannot be one.
    pub fn constraint(&self, grammar: &Grammar) -> Result<TokenConstraint, ConstraintError> {
        let top = match grammar {
            Grammar::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact_json_schema(schema))
            }
            Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Grammar::Regex(regex) => TopLevelGrammar::from_regex(regex),
        };
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| ConstraintError::Unsupported(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(ConstraintError::Unsupported(error));
        }
        Ok(TokenConstraint {
            matcher,
            prepared: None,
            failed: None,
            accepted: None,
        })
    }

    /// Whether `text` is one special token of the vocabulary (a grammar names it `<text>`
    /// rather than spelling it out in bytes, which no token would match).
    pub fn is_special_token(&self, text: &str) -> bool {
        self.factory
            .tok_env()
            .tok_trie()
            .get_special_token(text)
            .is_some()
    }
}

/// `schema` as it is enforced, so that every reply ends, whatever the model's preferences:
/// - written the way `json.dumps` writes (`", "` and `": "`, no other whitespace): JSON's
///   optional whitespace would let a model pad its output until `max_tokens` ends it unparsed;
/// - numbers held to what a double carries: integers within ±(2^53 - 1), I-JSON's
///   interoperable range (RFC 7493), and at most eight decimals, the finest `multipleOf` the
///   engine takes ([`FINEST_FRACTION`]); small models otherwise repeat a digit (`0.99999…`)
///   until `max_tokens`. Bounds and `multipleOf` the schema sets itself are kept.
pub fn compact_json_schema(schema: &Value) -> Value {
    let mut schema = match schema {
        Value::Bool(true) => Value::Object(Default::default()),
        schema => schema.clone(),
    };
    bound_numbers(&mut schema);
    if schema.is_object() {
        let options = JsonCompileOptions {
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            whitespace_flexible: false,
            ..JsonCompileOptions::default()
        };
        options.apply_to(&mut schema);
    }
    schema
}

/// What enforced numbers are multiples of (llguidance reads a finer one as more digits than
/// it takes).
pub const FINEST_FRACTION: f64 = 1e-8;

/// The largest integer a double holds exactly, less one (I-JSON's bound).
const SAFE_INTEGER: i64 = (1 << 53) - 1;

/// Adds [`compact_json_schema`]'s number bounds to every subschema of type `number` or
/// `integer`, leaving literal values (`enum`, `const`, `default`, `examples`) as they are.
fn bound_numbers(schema: &mut Value) {
    match schema {
        Value::Array(items) => items.iter_mut().for_each(bound_numbers),
        Value::Object(fields) => {
            let types: Vec<&str> = match fields.get("type") {
                Some(Value::String(kind)) => vec![kind.as_str()],
                Some(Value::Array(kinds)) => kinds.iter().filter_map(Value::as_str).collect(),
                _ => Vec::new(),
            };
            let number = types.contains(&"number");
            if number || types.contains(&"integer") {
                if !fields.contains_key("minimum") && !fields.contains_key("exclusiveMinimum") {
                    fields.insert("minimum".into(), (-SAFE_INTEGER).into());
                }
                if !fields.contains_key("maximum") && !fields.contains_key("exclusiveMaximum") {
                    fields.insert("maximum".into(), SAFE_INTEGER.into());
                }
                if number && !fields.contains_key("multipleOf") {
                    fields.insert("multipleOf".into(), FINEST_FRACTION.into());
                }
            }
            for (key, value) in fields.iter_mut() {
                if !matches!(key.as_str(), "enum" | "const" | "default" | "examples") {
                    bound_numbers(value);
                }
            }
        }
        _ => {}
    }
}

/// llguidance's view of the vocabulary: each token's bytes in a trie, and our tokenizer for
/// the text a grammar forces.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        // Forced text is a grammar's literal, valid UTF-8 but for a token's partial byte
        // sequences, which the trie splits greedily instead.
        match std::str::from_utf8(bytes) {
            Ok(text) => self
                .tokenizer
                .encode(text, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(bytes)),
            Err(_) => self.trie.greedy_tokenize(bytes),
        }
    }
}

/// One generation's grammar state: which tokens the next step may take, advanced by each one
/// taken.
#[derive(Clone)]
pub struct TokenConstraint {
    matcher: Matcher,
    /// The next step's allowed tokens, when [`prepare`](Self::prepare) computed them ahead.
    prepared: Option<Result<SimpleVob, String>>,
    /// Why [`take_allowed`](Self::take_allowed) had no tokens to give.
    failed: Option<ConstraintError>,
    /// A token [`accept_ahead`](Self::accept_ahead) advanced past, and what that gave.
    accepted: Option<(u32, Result<bool, ConstraintError>)>,
}

/// The tokens a step may take, a bit each: bit `id % 32` of word `id / 32` allows token `id`
/// (what `oxlm_engine::ops::greedy_rows_allowed` masks a pick with, where the logits are).
pub struct AllowedTokens(SimpleVob);

impl AllowedTokens {
    pub fn words(&self) -> &[u32] {
        self.0.as_slice()
    }
}

impl fmt::Debug for TokenConstraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenConstraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl TokenConstraint {
    /// Computes which tokens the next step allows, ahead of [`mask`](Self::mask): a batch's
    /// masks are computed on another thread while the model runs the step.
    pub fn prepare(&mut self) {
        if self.prepared.is_none() {
            self.prepared = Some(self.allowed());
        }
    }

    fn allowed(&mut self) -> Result<SimpleVob, String> {
        self.matcher
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())
    }

    /// The tokens the grammar allows next (at least one), computed ahead or now. Once the
    /// grammar is complete only end-of-sequence tokens are allowed.
    fn next_allowed(&mut self) -> Result<SimpleVob, ConstraintError> {
        let allowed = match self.prepared.take() {
            Some(prepared) => prepared,
            None => self.allowed(),
        }
        .map_err(ConstraintError::Matcher)?;
        if allowed.is_zero() {
            return Err(ConstraintError::Matcher(
                "the grammar allows no token from here".into(),
            ));
        }
        Ok(allowed)
    }

    /// The tokens the grammar allows next, for a pick made where the logits are; `None` when
    /// they cannot be had, which [`check_pick`](Self::check_pick) then reports.
    pub fn take_allowed(&mut self) -> Option<AllowedTokens> {
        match self.next_allowed() {
            Ok(allowed) => Some(AllowedTokens(allowed)),
            Err(e) => {
                self.failed = Some(e);
                None
            }
        }
    }

    /// Whether the pick made with [`take_allowed`](Self::take_allowed)'s tokens kept to the
    /// grammar: the error that left it without them, if one did.
    pub fn check_pick(&mut self) -> Result<(), ConstraintError> {
        self.failed.take().map_or(Ok(()), Err)
    }

    /// Sets the logits of the tokens the grammar does not allow next to -inf.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        let allowed = self.next_allowed()?;
        for (id, logit) in logits.iter_mut().enumerate() {
            if !allowed.is_allowed(id as TokenId) {
                *logit = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past `token` (not an end-of-sequence token); true once the grammar is complete
    /// and nothing but the end can follow.
    pub fn accept(&mut self, token: u32) -> Result<bool, ConstraintError> {
        match self.accepted.take() {
            Some((ahead, accepted)) if ahead == token => accepted,
            Some((ahead, _)) => Err(ConstraintError::Matcher(format!(
                "token {token} taken after the grammar advanced past {ahead}"
            ))),
            None => self.advance(token),
        }
    }

    /// [`accept`](Self::accept)'s work for `token`, done ahead of it, so that a batch's grammars
    /// advance side by side rather than one after another as their sequences take their tokens.
    pub fn accept_ahead(&mut self, token: u32) {
        let accepted = self.advance(token);
        self.accepted = Some((token, accepted));
    }

    fn advance(&mut self, token: u32) -> Result<bool, ConstraintError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError::Matcher(e.to_string()))?;
        self.prepared = None;
        Ok(self.matcher.is_stopped())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tiny/tokenizer"
        );
        Tokenizer::from_dir(dir).unwrap()
    }

    /// Greedy decoding under `grammar` from logits that favour `favourite`, whatever it is:
    /// the text the constraint lets through.
    fn decode(grammar: Grammar, favourite: &str) -> String {
        let tokenizer = tokenizer();
        let eos = tokenizer.eos_token_id().unwrap();
        let vocab = tokenizer.vocab_size();
        let grammars = Grammars::new(&tokenizer, &[eos], vocab).unwrap();
        let mut constraint = grammars.constraint(&grammar).unwrap();
        let favoured = tokenizer.encode(favourite, false).unwrap();
        let mut ids = Vec::new();
        for step in 0..200 {
            let mut logits = vec![0.0f32; vocab];
            // The favourite text's next token first, then anything else.
            logits[favoured[step % favoured.len()] as usize] = 5.0;
            constraint.mask(&mut logits).unwrap();
            let id = (0..vocab)
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                .unwrap() as u32;
            if id == eos {
                break;
            }
            ids.push(id);
            if constraint.accept(id).unwrap() {
                break;
            }
        }
        tokenizer.decode(&ids, false).unwrap()
    }

    #[test]
    fn a_schema_holds_whatever_the_model_favours() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"],
            "additionalProperties": false,
        });
        let text = decode(Grammar::JsonSchema(schema), "hello world");
        let value: Value = serde_json::from_str(&text).unwrap();
        let n = value["n"].as_i64().unwrap();
        assert!((0..=9).contains(&n), "{text}");
        assert_eq!(value.as_object().unwrap().len(), 1, "{text}");
    }

    #[test]
    fn numbers_end_however_much_the_model_favours_another_digit() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "x": {"type": "number", "minimum": 0, "maximum": 1},
                "n": {"type": "integer"},
                "literal": {"enum": [{"type": "number"}]},
            },
            "required": ["x", "n", "literal"],
            "additionalProperties": false,
        });
        let text = decode(Grammar::JsonSchema(schema), "9");
        // The model's favourite digit as far as the bounds let it go, then the end.
        assert_eq!(
            text,
            "{\"x\": 1.00000000, \"n\": 999999999999999, \"literal\": {\"type\": \"number\"}}"
        );
    }

    #[test]
    fn a_regex_holds() {
        let text = decode(Grammar::Regex("(yes|no)".into()), "maybe");
        assert!(text == "yes" || text == "no", "{text}");
    }

    #[test]
    fn what_cannot_be_enforced_is_an_error() {
        let tokenizer = tokenizer();
        let eos = tokenizer.eos_token_id().unwrap();
        let grammars = Grammars::new(&tokenizer, &[eos], tokenizer.vocab_size()).unwrap();
        let schema = serde_json::json!({"$ref": "https://example.com/schema.json"});
        let error = grammars
            .constraint(&Grammar::JsonSchema(schema))
            .unwrap_err();
        assert!(matches!(error, ConstraintError::Unsupported(_)), "{error}");
        let error = grammars
            .constraint(&Grammar::Lark("start: undefined_rule".into()))
            .unwrap_err();
        assert!(error.to_string().contains("undefined_rule"), "{error}");
    }
}
