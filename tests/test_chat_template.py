"""A chat template that cannot be rendered falls back to a plain transcript, and says why."""

from __future__ import annotations

from engine import chat_template


class TemplateModel:
    """What chat_template.render needs of a model: no native template, a Jinja one."""

    def __init__(self, template: str | None) -> None:
        self.chat_template = template

    def apply_chat_template_native(self, messages, add_assistant):
        return None


def test_a_broken_template_falls_back_and_says_why():
    model = TemplateModel("{% for m in messages %}{{ m.content }")   # unterminated tag
    text = chat_template.render(model, [("user", "Hi")], add_assistant=True)
    assert text == "User: Hi\n\nAssistant:"
    problem = chat_template.template_problem(model)
    assert problem and "could not be used" in problem and "TemplateSyntaxError" in problem


def test_a_working_or_missing_template_is_no_problem():
    good = TemplateModel("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert chat_template.render(good, [("user", "Hi")], add_assistant=False) == "<user>Hi"
    assert chat_template.template_problem(good) is None
    none = TemplateModel(None)
    assert chat_template.render(none, [("user", "Hi")], add_assistant=True).startswith("User: Hi")
    assert chat_template.template_problem(none) is None


def test_the_worker_tells_the_user_once(smollm_path, tmp_path, monkeypatch):
    import threading

    from engine.checkpoints.store import Store
    from engine.sampling import SamplerSettings
    from engine.worker import EngineWorker, ModelOptions, WorkerListener
    from native.model import Model
    monkeypatch.setattr(Model, "apply_chat_template_native", lambda self, m, a: None)
    monkeypatch.setattr(Model, "chat_template", property(lambda self: "{{ broken"))

    class Recorder(WorkerListener):
        def __init__(self):
            self.notices, self.finished = [], threading.Semaphore(0)

        def on_notice(self, e):
            self.notices.append((e.title, e.message))

        def on_generation_finished(self, summary):
            self.finished.release()

    rec = Recorder()
    w = EngineWorker(rec, Store(tmp_path / "store"))
    w.start()
    try:
        w.load_model(ModelOptions(smollm_path, n_ctx=512, n_threads=2))
        conv = w.new_conversation(sampler=SamplerSettings(seed=1))
        w.send(conv, "Hello", n_predict=2)
        assert rec.finished.acquire(timeout=120)
        w.send(conv, "Again", n_predict=2)
        assert rec.finished.acquire(timeout=120)
    finally:
        w.shutdown()
        assert w.join(60)
    assert len(rec.notices) == 1 and rec.notices[0][0] == "Chat template"
    assert "plain" in rec.notices[0][1]
