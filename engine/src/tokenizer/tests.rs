//! Unit tests on a tiny byte-level BPE built in code (no model file needed).

use super::*;

/// GPT-2's byte -> printable character map, in byte order.
fn byte_chars() -> Vec<char> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                char::from(b)
            } else {
                let c = char::from_u32(next).unwrap_or('?');
                next += 1;
                c
            }
        })
        .collect()
}

/// Ids: 0 `<|endoftext|>`, 1 `<|im_start|>`, 2 `<|im_end|>` (control),
/// 3..259 the 256 bytes, then merged tokens, then `<tool>` (user-defined).
pub(crate) fn tiny_parts() -> TokenizerParts {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from).to_vec();
    let mut token_types = vec![TOKEN_TYPE_CONTROL; 3];
    tokens.extend(byte_chars().into_iter().map(String::from));
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "1 2"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    tokens.push("<tool>".to_owned());
    token_types.resize(tokens.len() - 1, 1);
    token_types.push(TOKEN_TYPE_USER_DEFINED);
    TokenizerParts {
        model: "gpt2".to_owned(),
        pre: "smollm".to_owned(),
        tokens,
        token_types,
        merges: merges.map(String::from).to_vec(),
        bos_id: Some(1),
        eos_id: Some(0),
        eot_id: None,
        add_bos: false,
        chat_template: Some(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}".to_owned(),
        ),
    }
}

pub(crate) fn tiny() -> Result<Tokenizer, TokenizerError> {
    Tokenizer::from_parts(tiny_parts())
}

fn id_of(tok: &Tokenizer, piece: &str) -> Option<u32> {
    (0..tok.vocab_size() as u32).find(|&id| tok.token_piece(id) == Some(piece))
}

#[test]
fn merges_apply_in_priority_order() -> Result<(), TokenizerError> {
    let tok = tiny()?;
    let ids = tok.encode("hello wo", false)?;
    let pieces: Vec<_> = ids.iter().map(|&id| tok.token_piece(id)).collect();
    assert_eq!(pieces, [Some("hello"), Some("Ġwo")]);
    assert_eq!(tok.decode(&ids, false)?, "hello wo");
    Ok(())
}

#[test]
fn digits_are_split_one_by_one() -> Result<(), TokenizerError> {
    let tok = tiny()?;
    // "1 2" is a merge, but the smollm pre-tokenizer isolates every digit first.
    let ids = tok.encode("12", false)?;
    assert_eq!(ids.len(), 2);
    let mut parts = tiny_parts();
    parts.pre = "gpt2".to_owned();
    let gpt2 = Tokenizer::from_parts(parts)?;
    assert_eq!(gpt2.encode("12", false)?, [id_of(&gpt2, "12").unwrap_or(u32::MAX)]);
    Ok(())
}

#[test]
fn special_tokens_parse_only_when_asked() -> Result<(), TokenizerError> {
    let tok = tiny()?;
    let text = "<|im_start|>hello<|im_end|>";
    let special = tok.encode(text, true)?;
    assert_eq!(special.first(), Some(&1));
    assert_eq!(special.last(), Some(&2));
    assert_eq!(special.len(), 3);
    let plain = tok.encode(text, false)?;
    assert!(!plain.contains(&1) && !plain.contains(&2), "{plain:?}");
    assert_eq!(tok.decode(&plain, true)?, text);
    assert_eq!(tok.decode(&special, false)?, text);
    assert_eq!(tok.decode(&special, true)?, "hello");
    Ok(())
}

#[test]
fn user_defined_tokens_always_match() -> Result<(), TokenizerError> {
    let tok = tiny()?;
    let tool = id_of(&tok, "<tool>").unwrap_or(u32::MAX);
    assert_eq!(tok.encode("<tool>", true)?, [tool]);
    assert_eq!(tok.encode("<tool>", false)?, [tool]);
    assert!(!tok.is_special(tool));
    assert_eq!(tok.decode(&[tool], true)?, "<tool>");
    Ok(())
}

#[test]
fn accessors_and_stop_ids() -> Result<(), TokenizerError> {
    let tok = tiny()?;
    assert_eq!(tok.vocab_size(), 3 + 256 + 7 + 1);
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(1), Some(0)));
    // eos, then <|im_end|> because the template writes it.
    assert_eq!(tok.eos_ids(), [0, 2]);
    assert!(tok.is_special(0) && tok.is_special(2) && !tok.is_special(3));
    assert!(!tok.is_special(u32::MAX));
    assert_eq!(tok.token_piece(1), Some("<|im_start|>"));
    assert_eq!(tok.token_piece(tok.vocab_size() as u32), None);
    let err = tok.decode(&[3, tok.vocab_size() as u32], false);
    assert!(matches!(err, Err(TokenizerError::InvalidTokenId { id, .. }) if id as usize == tok.vocab_size()));
    Ok(())
}

#[test]
fn add_bos_prepends_once() -> Result<(), TokenizerError> {
    let mut parts = tiny_parts();
    parts.add_bos = true;
    let tok = Tokenizer::from_parts(parts)?;
    let ids = tok.encode("hello", false)?;
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.len(), 2);
    // A rendered template that already starts with BOS does not get a second.
    assert_eq!(tok.encode("<|im_start|>hello", true)?, ids);
    assert_eq!(tok.encode("", false)?, [1]);
    Ok(())
}

#[test]
fn digest_covers_merges_pre_and_specials() -> Result<(), TokenizerError> {
    let base = tiny()?.digest();
    assert_eq!(tiny()?.digest(), base);
    let mut fewer = tiny_parts();
    fewer.merges.pop();
    assert_ne!(Tokenizer::from_parts(fewer)?.digest(), base);
    let mut pre = tiny_parts();
    pre.pre = "gpt2".to_owned();
    assert_ne!(Tokenizer::from_parts(pre)?.digest(), base);
    let mut specials = tiny_parts();
    specials.token_types[0] = 1;
    assert_ne!(Tokenizer::from_parts(specials)?.digest(), base);
    // Not part of tokenization: the chat template.
    let mut template = tiny_parts();
    template.chat_template = None;
    assert_eq!(Tokenizer::from_parts(template)?.digest(), base);
    Ok(())
}

#[test]
fn malformed_parts_are_typed_errors() {
    let build = |f: fn(&mut TokenizerParts)| {
        let mut p = tiny_parts();
        f(&mut p);
        Tokenizer::from_parts(p)
    };
    assert!(matches!(build(|p| p.merges.push("nospace".into())), Err(TokenizerError::BadMerge { index: 7, .. })));
    assert!(matches!(build(|p| p.merges.push(" h".into())), Err(TokenizerError::BadMerge { .. })));
    assert!(matches!(build(|p| p.merges.push("h x".into())), Err(TokenizerError::Build(_))));
    assert!(matches!(build(|p| p.model = "llama".into()), Err(TokenizerError::UnsupportedModel(m)) if m == "llama"));
    assert!(
        matches!(build(|p| p.pre = "qwen2".into()), Err(TokenizerError::UnsupportedPreTokenizer(m)) if m == "qwen2")
    );
    assert!(matches!(
        build(|p| {
            p.token_types.pop();
        }),
        Err(TokenizerError::TokenTypeCount { .. })
    ));
    assert!(matches!(
        build(|p| p.tokens[5] = p.tokens[4].clone()),
        Err(TokenizerError::DuplicateToken { first: 4, second: 5, .. })
    ));
    assert!(matches!(
        build(|p| p.eos_id = Some(100_000)),
        Err(TokenizerError::SpecialIdOutOfRange { what: "eos", .. })
    ));
    assert!(matches!(
        build(|p| {
            p.bos_id = None;
            p.add_bos = true;
        }),
        Err(TokenizerError::MissingBos)
    ));
}

#[test]
fn duplicate_merges_keep_the_first() -> Result<(), TokenizerError> {
    let mut parts = tiny_parts();
    parts.merges.push("h e".to_owned());
    let tok = Tokenizer::from_parts(parts)?;
    assert_eq!(tok.encode("hello", false)?.len(), 1);
    Ok(())
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
    check::<IncrementalDecoder>();
}
