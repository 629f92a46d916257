"""The chat app: conversation on the left, KV panel on the right, input at the bottom.

All engine calls go to the single MLX worker thread (tui.worker) as jobs; their events
come back through an EventPipe and are applied here, on the UI thread, in order.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from mlxkv.engine.events import Finished, Notice, PrefillProgress, TokenDelta
from mlxkv.errors import UserError
from mlxkv.paths import home
from tui import slash
from tui.chat_view import ChatLog, MessageView, Note
from tui.cpu import split_cpu
from tui.engine import ChatEngine
from tui.loading import LoadingScreen
from tui.panel import KVPanel
from tui.pipe import Done, EventPipe, Failed, Status
from tui.prompt_input import PromptInput
from tui.worker import MLXWorker

ANSWERING = "answering ... Esc stops · you can keep typing"
READY = "Enter send · Shift+Enter newline · ↑ history · Esc stop · /help"


def _log_crash(job: str) -> str:
    """Keep the traceback of an unexpected failure out of the UI, in a log file."""
    try:
        path = home() / "tui-errors.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(f"--- {datetime.now().isoformat()} job {job}\n{traceback.format_exc()}\n")
        return f" (details in {path})"
    except OSError:
        return ""


class ChatApp(App):
    TITLE = "mlxkv chat"
    CSS = """
    #main { height: 1fr; }
    #chat-col { width: 1fr; }
    #status { height: 1; padding: 0 1; color: $text-muted; }
    #status.busy { color: $warning; }
    """
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("ctrl+y", "copy_last", "Copy answer"),
        Binding("f1", "help", "Help"),
    ]

    class Wake(Message):
        """The worker queued something in the pipe."""

    def __init__(
        self,
        engine: ChatEngine,
        model: str | None = None,
        metrics_path=None,
        cursor_blink: bool = True,  # off in snapshots: a blink phase makes two pictures
    ):
        super().__init__()
        self.cursor_blink = cursor_blink
        self.engine = engine
        self.model = model
        self.worker = MLXWorker()
        self.pipe = EventPipe(lambda: self.post_message(self.Wake()))
        self.busy: str | None = None  # name of the running job
        self._stop = threading.Event()
        self._streaming: MessageView | None = None
        self._pending_text = ""  # the prompt of the running turn (given back on failure)
        self._question: MessageView | None = None  # its view
        self._turn_cpu: tuple[float, float] | None = None
        self._prefilling = False
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.metrics: dict = {"turns": []}

    # -- layout ----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat-col"):
                yield ChatLog(id="chat")
                yield Static(READY, id="status")
                prompt = PromptInput(id="prompt")
                prompt.cursor_blink = self.cursor_blink
                yield prompt
            yield KVPanel(id="panel")
        yield Footer()

    # The chat widgets live on the first screen; a loading screen may be on top of it.
    @property
    def main(self) -> Screen:
        return self.screen_stack[0]

    @property
    def chat(self) -> ChatLog:
        return self.main.query_one(ChatLog)

    @property
    def panel(self) -> KVPanel:
        return self.main.query_one(KVPanel)

    @property
    def prompt(self) -> PromptInput:
        return self.main.query_one(PromptInput)

    def on_mount(self) -> None:
        self.metrics["mounted"] = time.perf_counter()
        self.prompt.focus()
        self.load_model(self.model)

    def set_status(self, text: str | None = None) -> None:
        status = self.main.query_one("#status", Static)
        status.update(text or READY)
        status.set_class(bool(self.busy), "busy")

    async def note(self, text: str, kind: str = "info") -> None:
        await self.chat.add(Note(text, kind))

    # -- jobs on the MLX worker ------------------------------------------------------------
    def _run_job(self, name: str, fn: Callable[[], object]) -> None:
        self.busy = name
        pipe = self.pipe

        def job():
            try:
                result = fn()
            except UserError as e:
                pipe.put(Failed(name, str(e)))
            except Exception as e:  # noqa: BLE001 - shown in the UI, traceback to a log
                pipe.put(Failed(name, f"{type(e).__name__}: {e}{_log_crash(name)}"))
            else:
                pipe.put(Done(name, result))

        self.worker.submit(job)

    def _refuse_if_busy(self) -> bool:
        if self.busy:
            what = "answering" if self.busy == "turn" else f"busy ({self.busy})"
            self.notify(f"still {what}: press Esc to stop it first", severity="warning")
            return True
        return False

    def load_model(self, model: str | None) -> None:
        self.metrics["load_started"] = time.perf_counter()
        screen = LoadingScreen(model, can_go_back=self.engine.loaded)
        self.push_screen(screen)
        engine, pipe = self.engine, self.pipe

        def load():
            engine.open(model, on_status=lambda m: pipe.put(Status("load", m)))
            return engine.idle_stats()

        self._run_job("load", load)

    def _turn(self, kind: str, text: str = "") -> None:
        self._stop = threading.Event()
        stop, engine, pipe = self._stop, self.engine, self.pipe

        def turn():
            events = engine.send(text, stop) if kind == "send" else engine.regenerate(stop)
            for ev in events:
                pipe.put(ev)

        self._turn_cpu = split_cpu(self.worker.native_id)
        self._run_job("turn", turn)
        self.set_status(ANSWERING)

    # -- events from the worker ------------------------------------------------------------
    async def on_chat_app_wake(self, _msg: Wake) -> None:
        if self._closing or not self.screen_stack:
            return  # shutting down
        text: list[str] = []
        for item in self.pipe.drain():
            if isinstance(item, TokenDelta):
                if self._prefilling:
                    self._prefilling = False
                    self.set_status(ANSWERING)
                text.append(item.text)  # consecutive deltas become one append
                self.panel.show(item.stats)
                continue
            if text:
                await self._append("".join(text))
                text = []
            await self._apply(item)
        if text:
            await self._append("".join(text))

    async def _append(self, delta: str) -> None:
        if self._streaming is not None:
            await self._streaming.append(delta)

    async def _apply(self, item) -> None:
        if isinstance(item, PrefillProgress):
            self._prefilling = True
            self.set_status(f"reading the prompt: {item.done}/{item.total} tokens · Esc stops")
        elif isinstance(item, Notice):
            await self.note(item.message, "notice")
        elif isinstance(item, Finished):
            await self._finished(item)
        elif isinstance(item, Status):
            if isinstance(self.screen, LoadingScreen):
                self.screen.status(item.message)
        elif isinstance(item, Done | Failed):
            self.busy = None
            handler = getattr(self, f"_after_{item.job}")
            await handler(item)
            if not self.busy:
                self.set_status()

    async def _finished(self, ev: Finished) -> None:
        s = ev.stats
        self.panel.show(s)
        reason = {"cancelled": "stopped (Esc)", "stop": "done"}.get(ev.finish_reason)
        meta = (
            f"{reason or ev.finish_reason} · {s.generation_tokens} tokens · "
            f"{s.generation_tps:.1f} tok/s"
        )
        if self._streaming is not None:
            await self._streaming.finish(ev.text, meta)
            self._streaming = None
        cpu = {}
        end = split_cpu(self.worker.native_id)
        if end and self._turn_cpu:
            ui, engine = end[0] - self._turn_cpu[0], end[1] - self._turn_cpu[1]
            share = ui / (ui + engine) if ui + engine > 0 else None  # a turn under one tick
            cpu = {"ui_cpu_s": ui, "engine_cpu_s": engine, "ui_cpu_share": share}
        self.metrics["turns"].append(
            {
                **cpu,
                "generation_tokens": s.generation_tokens,
                "generation_tps": s.generation_tps,
                "prompt_tps": s.prompt_tps,
                "finish_reason": ev.finish_reason,
                "kv_bytes_actual": s.kv_bytes_actual,
                "kv_bytes_predicted": s.kv_bytes_predicted,
            }
        )
        self.write_metrics()

    # -- job results -----------------------------------------------------------------------
    async def _after_load(self, item) -> None:
        screen = self.screen if isinstance(self.screen, LoadingScreen) else None
        if isinstance(item, Failed):
            if screen is not None:
                screen.failed(item.message)
            else:
                await self.note(f"could not load the model: {item.message}", "error")
            return
        loaded_at = time.perf_counter()
        self.metrics["load_seconds"] = loaded_at - self.metrics["load_started"]
        if screen is not None:
            self.pop_screen()
        self.sub_title = f"{self.engine.model_name} · {self.engine.policy.describe()}"
        self.panel.budget = self.engine.budget
        self.panel.reset_plot()
        self.panel.show(item.result)
        self.prompt.focus()
        carried = len(self.engine.messages)
        text = f"loaded {self.engine.model_name} (KV policy: {self.engine.policy.describe()})"
        if carried:
            text += f"; the {carried} messages so far are read again on the next turn"
        await self.note(text)

        def painted():
            self.metrics["first_paint_after_load"] = time.perf_counter() - loaded_at
            self.write_metrics()

        self.call_after_refresh(painted)

    async def _after_turn(self, item) -> None:
        question, self._question = self._question, None
        view, self._streaming = self._streaming, None
        if isinstance(item, Done):
            return
        # The engine recorded no answer (and took back an unanswered message): the view
        # follows, the error stays visible, and the typed text returns to the input box.
        await self.note(item.message, "error")
        if view is not None:
            await view.remove()
        sent = self._pending_text
        kept = any(m["role"] == "user" and m["content"] == sent for m in self.engine.messages[-1:])
        if question is not None and not kept:
            await question.remove()
        if sent and not self.prompt.text:
            self.prompt.load_text(sent)
            self.prompt.move_cursor(self.prompt.document.end)

    async def _after_policy(self, item) -> None:
        if isinstance(item, Failed):
            await self.note(f"policy unchanged: {item.message}", "error")
            return
        self.sub_title = f"{self.engine.model_name} · {self.engine.policy.describe()}"
        self.panel.reset_plot()
        self.panel.show(item.result)
        n = len(self.engine.messages)
        await self.note(
            f"KV policy is now {self.engine.policy.describe()}. The old cache was dropped"
            + (f"; the {n} messages so far are read again on the next turn." if n else ".")
        )

    async def _after_clear(self, item) -> None:
        if isinstance(item, Failed):
            await self.note(item.message, "error")
            return
        await self.chat.remove_children()
        self.panel.reset_plot()
        self.panel.show(item.result)
        await self.note("cleared: conversation and KV cache dropped")

    async def _after_load_transcript(self, item) -> None:
        if isinstance(item, Failed):
            await self.note(item.message, "error")
            return
        path = item.result[1]
        await self._show_transcript()
        self.panel.reset_plot()
        self.panel.show(item.result[0])
        await self.note(f"loaded {path}; the cache is rebuilt on the next turn")

    async def _show_transcript(self) -> None:
        await self.chat.remove_children()
        if self.engine.system:
            await self.note(f"system prompt: {self.engine.system}")
        for m in self.engine.messages:
            await self.chat.add(MessageView(m["role"], m["content"]))

    # -- input -----------------------------------------------------------------------------
    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text
        command = slash.parse(text)
        if command is not None:
            self.prompt.remember(text)
            if await self.run_command(command):
                self.prompt.clear()
            return
        if not text.strip():
            self.notify("the message is empty: type something to send", severity="warning")
            return
        if not self.engine.loaded:
            self.notify("no model is loaded yet", severity="warning")
            return
        if self._refuse_if_busy():
            return  # the text stays in the box
        if text.strip().startswith("//"):
            text = text.strip()[1:]
        self.prompt.remember(event.text)
        self.prompt.clear()
        self._pending_text = text
        self._question = MessageView("user", text)
        await self.chat.add(self._question)
        self._streaming = MessageView("assistant")
        await self.chat.add(self._streaming)
        self.chat.anchor()  # sending brings the view back to the bottom
        self._turn("send", text)

    async def run_command(self, cmd: slash.Command) -> bool:
        """Run a slash command; False keeps the text in the input (e.g. it was refused)."""
        name, arg = cmd.name, cmd.arg
        if name in ("/help", "/?"):
            await self.action_help()
        elif name == "/copy":
            self.action_copy_last()
        elif name not in slash.COMMANDS:
            await self.note(f"unknown command {name}; /help lists them", "error")
            return False
        elif self._refuse_if_busy():
            return False
        elif name == "/policy":
            try:
                policy = slash.parse_policy(arg, self.engine.policy)
            except UserError as e:
                await self.note(str(e), "error")
                return False
            self.set_policy(policy)
        elif name == "/system":
            if not arg:
                await self.note(f"system prompt: {self.engine.system or '(none)'}")
            else:
                self.engine.set_system("" if arg == "-" else arg)
                await self.note(f"system prompt set to: {self.engine.system or '(none)'}")
        elif name == "/clear":
            await self.action_clear()
        elif name == "/regen":
            await self.action_regenerate()
        elif name == "/save":
            return await self.save(arg)
        elif name == "/load":
            if not arg:
                await self.note("usage: /load PATH.json", "error")
                return False
            self.load_transcript(arg)
        elif name == "/model":
            if not arg:
                await self.note(f"model: {self.engine.model_name}; usage: /model NAME", "error")
                return False
            self.load_model(arg)
        return True

    # -- actions ---------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.busy == "turn":
            self._stop.set()
            self.engine.cancel()  # thread-safe: the loop stops after its current token
            self.set_status("stopping ...")

    async def action_regenerate(self) -> None:
        if self._refuse_if_busy():
            return
        if not any(m["role"] == "user" for m in self.engine.messages):
            await self.note("nothing to regenerate yet: send a message first", "error")
            return
        last = self.chat.last_message()
        if last is not None and last.role == "assistant":
            await last.remove()
        self._pending_text, self._question = "", None
        self._streaming = MessageView("assistant")
        await self.chat.add(self._streaming)
        self.chat.anchor()
        self._turn("regenerate")

    async def action_clear(self) -> None:
        if self._refuse_if_busy():
            return
        engine = self.engine

        def clear():
            engine.clear()
            return engine.idle_stats()

        self._run_job("clear", clear)

    def set_policy(self, policy) -> None:
        engine = self.engine

        def change():
            engine.set_policy(policy)
            return engine.idle_stats()

        self._run_job("policy", change)

    async def save(self, arg: str) -> bool:
        path = Path(arg or f"mlxkv-chat-{datetime.now():%Y%m%d-%H%M%S}.json").expanduser()
        try:
            self.engine.save(path)
        except UserError as e:
            await self.note(str(e), "error")
            return False
        await self.note(f"saved the transcript to {path}")
        return True

    def load_transcript(self, arg: str) -> None:
        engine, path = self.engine, Path(arg).expanduser()

        def load():
            engine.load(path)
            return engine.idle_stats(), path

        self._run_job("load_transcript", load)

    def action_copy_last(self) -> None:
        last = self.chat.last_message("assistant")
        if last is None:
            self.notify("no answer to copy yet", severity="warning")
            return
        last.action_copy()

    async def action_help(self) -> None:
        await self.note(slash.help_text())

    def on_loading_screen_retry(self, msg: LoadingScreen.Retry) -> None:
        engine, pipe = self.engine, self.pipe
        self.metrics["load_started"] = time.perf_counter()

        def load():
            engine.open(msg.model, on_status=lambda m: pipe.put(Status("load", m)))
            return engine.idle_stats()

        self._run_job("load", load)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Stop the answer", "Esc", self.action_stop)
        yield SystemCommand("Regenerate", "answer the last message again", self.action_regenerate)
        yield SystemCommand("Clear the chat", "drop conversation and KV cache", self.action_clear)
        yield SystemCommand("Copy the last answer", "to the clipboard", self.action_copy_last)
        yield SystemCommand("Save the transcript", "as JSON in this folder", lambda: self.save(""))
        yield SystemCommand("Keys and commands", "help", self.action_help)
        presets = {
            "full cache": "full bits=none",
            "sink 4 + window 256": "window=256 sinks=4 bits=none",
            "4-bit quantized": "bits=4",
            "8-bit quantized": "bits=8",
        }
        for label, spec in presets.items():
            yield SystemCommand(
                f"KV policy: {label}",
                "drops the current cache; the conversation is read again",
                lambda spec=spec: self.run_command(slash.Command("/policy", spec)),
            )

    # -- metrics and exit ------------------------------------------------------------------
    def write_metrics(self) -> None:
        if self.metrics_path is None:
            return
        data = {k: v for k, v in self.metrics.items() if k not in ("mounted", "load_started")}
        lat = self.prompt.key_latencies
        if lat:
            data["key_latency_ms"] = {
                "count": len(lat),
                "max": max(lat) * 1000,
                "median": sorted(lat)[len(lat) // 2] * 1000,
            }
        data["panel_renders"] = self.panel.renders
        self.metrics_path.write_text(json.dumps(data, indent=2))

    async def action_quit(self) -> None:
        self._stop.set()
        self.engine.cancel()
        self.write_metrics()
        self.exit()

    def on_unmount(self) -> None:
        self.engine.cancel()
        self.worker.stop(timeout=2.0)
