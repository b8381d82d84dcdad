//! The model's chat template, rendered with minijinja.
//!
//! Models ship their prompt format as a Jinja template written for Python's
//! jinja2 (`tokenizer.chat_template`), so the engine renders the model's own
//! template instead of hard-coding formats: a new model then needs no code.
//! The environment copies what transformers sets up for
//! `apply_chat_template`: `trim_blocks` and `lstrip_blocks`, Python string
//! methods (`.strip()`, `.startswith()`, via minijinja-contrib's pycompat),
//! the variables `messages`, `add_generation_prompt`, `bos_token` and
//! `eos_token`, and a `raise_exception(msg)` function, which templates use to
//! reject conversations they cannot format.
//!
//! A template that does not compile is recorded, not fatal: the model still
//! serves plain completions, and only chat requests get the error.

use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use super::TokenizerError;

const TEMPLATE_NAME: &str = "chat_template";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// "system", "user" or "assistant" (the template decides what it accepts).
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// Marks an error as coming from the template's own `raise_exception`, so
/// it can be told apart from a failure of the renderer.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct RaisedException(String);

/// The chat template as loaded from the model.
pub(super) enum ChatState {
    /// The model has none.
    Missing,
    /// It does not compile; the message says why.
    Broken(String),
    Ready(Box<ChatTemplate>),
}

pub(super) struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatState {
    /// Compiles `source` once. `bos_token`/`eos_token` are the texts the
    /// template may write (empty when the model has no such token).
    pub(super) fn new(source: Option<String>, bos_token: String, eos_token: String) -> Self {
        let Some(source) = source else {
            return Self::Missing;
        };
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        match env.add_template_owned(TEMPLATE_NAME, source) {
            Ok(()) => Self::Ready(Box::new(ChatTemplate { env, bos_token, eos_token })),
            Err(e) => {
                tracing::warn!(error = %e, "the model's chat template does not compile; chat is unavailable");
                Self::Broken(e.to_string())
            }
        }
    }

    pub(super) fn is_present(&self) -> bool {
        !matches!(self, Self::Missing)
    }

    /// The prompt text for `messages`; with `add_generation_prompt` it ends
    /// with the opening of an assistant turn, ready for generation.
    pub(super) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let t = match self {
            Self::Missing => return Err(TokenizerError::NoChatTemplate),
            Self::Broken(why) => return Err(TokenizerError::TemplateSyntax(why.clone())),
            Self::Ready(t) => t,
        };
        let template = t.env.get_template(TEMPLATE_NAME).map_err(|e| TokenizerError::TemplateSyntax(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &t.bos_token,
                eos_token => &t.eos_token,
            })
            .map_err(render_error)
    }
}

fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(RaisedException(msg)))
}

fn render_error(e: minijinja::Error) -> TokenizerError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(s) = source {
        if let Some(raised) = s.downcast_ref::<RaisedException>() {
            return TokenizerError::TemplateException(raised.0.clone());
        }
        source = s.source();
    }
    TokenizerError::TemplateRender(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nDefault<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn state(source: &str) -> ChatState {
        ChatState::new(Some(source.to_owned()), "<s>".to_owned(), "</s>".to_owned())
    }

    #[test]
    fn renders_chatml_with_default_system_prompt() {
        let out = state(CHATML).render(&[ChatMessage::new("user", "Hi")], true);
        assert_eq!(
            out.ok().as_deref(),
            Some("<|im_start|>system\nDefault<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        );
    }

    #[test]
    fn python_methods_and_special_token_variables_work() {
        let out = state("{{ bos_token }}{{ messages[0].content.strip() }}{{ eos_token }}")
            .render(&[ChatMessage::new("user", "  padded \n")], false);
        assert_eq!(out.ok().as_deref(), Some("<s>padded</s>"));
    }

    #[test]
    fn trim_and_lstrip_blocks_match_transformers() {
        let src =
            "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}";
        let out = state(src).render(&[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")], false);
        assert_eq!(out.ok().as_deref(), Some("[a]\n[b]\n"));
    }

    #[test]
    fn raise_exception_is_a_typed_error() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok";
        let err = state(src).render(&[ChatMessage::new("assistant", "x")], false);
        match err {
            Err(TokenizerError::TemplateException(msg)) => {
                assert_eq!(msg, "first message must be user")
            }
            other => panic!("expected TemplateException, got {other:?}"),
        }
        assert_eq!(state(src).render(&[ChatMessage::new("user", "x")], false).ok().as_deref(), Some("ok"));
    }

    #[test]
    fn missing_broken_and_failing_templates_are_typed_errors() {
        let none = ChatState::new(None, String::new(), String::new());
        assert!(matches!(none.render(&[], true), Err(TokenizerError::NoChatTemplate)));
        assert!(matches!(state("{% for %}").render(&[], true), Err(TokenizerError::TemplateSyntax(_))));
        let err = state("{{ messages[0].content.nosuchmethod() }}").render(&[ChatMessage::new("user", "x")], false);
        match err {
            Err(TokenizerError::TemplateRender(msg)) => {
                assert!(msg.contains("nosuchmethod") || msg.contains("method"), "{msg}")
            }
            other => panic!("expected TemplateRender, got {other:?}"),
        }
    }

    #[test]
    fn messages_deserialize_from_openai_shape() {
        let m: Result<Vec<ChatMessage>, _> = serde_json::from_str(r#"[{"role":"user","content":"Hi"}]"#);
        assert_eq!(m.ok(), Some(vec![ChatMessage::new("user", "Hi")]));
    }
}
