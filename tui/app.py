"""The chat app: conversation on the left, KV panel on the right, input at the bottom.

All engine calls go to the single MLX worker thread (tui.worker) as jobs; their events
come back through an EventPipe and are applied here, on the UI thread, in order.
"""

from __future__ import annotations

import asyncio
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
from mlxkv.policy import KVPolicy
from tui import metrics, slash
from tui.chat_view import ChatLog, MessageView, Note
from tui.conversations import ConversationStore, policy_from_dict, read_conversation
from tui.cpu import split_cpu
from tui.engine import ChatEngine
from tui.loading import LoadingScreen
from tui.panel import KVPanel
from tui.pipe import Done, EventPipe, Failed, Progress, Status
from tui.prompt_input import PromptInput
from tui.worker import MLXWorker

ANSWERING = "answering ... Esc or Ctrl+C stops · you can keep typing"
SHOWN = 50  # messages of a reopened conversation put on screen (the last ones)
QUIT_WAIT = 10.0  # seconds quitting waits for the worker's job (a stopped answer) to end
READY = "Enter send · Shift+Enter newline · Esc stop · /help · Ctrl+Q quit"
PANEL_MIN_WIDTH = 80  # narrower, the KV panel (46 cells) would leave the chat under 34


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
    Screen.-narrow KVPanel, Screen.-panel-off KVPanel { display: none; }
    Screen.-narrow.-panel-on KVPanel { display: block; }
    """
    # The panel hides itself on a narrow terminal; F2 shows or hides it at any width.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (PANEL_MIN_WIDTH, "-wide")]
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        # Priority: the input box binds Ctrl+C (copy) and Ctrl+Y (redo) itself.
        Binding("ctrl+c", "interrupt", "Stop", show=False, priority=True),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("ctrl+y", "copy_last", "Copy answer", priority=True),
        Binding("f1", "help", "Help"),
        Binding("f2", "toggle_panel", "KV panel"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    class Wake(Message):
        """The worker queued something in the pipe."""

    def __init__(
        self,
        engine: ChatEngine,
        model: str | None = None,
        metrics_path=None,
        cursor_blink: bool = True,  # off in snapshots: a blink phase makes two pictures
        store: ConversationStore | None = None,  # None: conversations are not kept
        resume: dict | None = None,  # a saved conversation to reopen once the model loads
    ):
        super().__init__()
        self.store = store
        self._resume = resume
        self._pending_policy: KVPolicy | None = None  # shown with its cost, not yet applied
        self._prefill_tps = 0.0  # the last measured prefill speed, for cost estimates
        self._after = {  # job name -> what to do with its result on the UI thread
            "load": self._after_load,
            "turn": self._after_turn,
            "policy": self._after_policy,
            "clear": self._after_clear,
            "restore": self._after_restore,
        }
        self.cursor_blink = cursor_blink
        self.engine = engine
        self.model = model
        self.worker = MLXWorker()
        self.pipe = EventPipe(lambda: self.post_message(self.Wake()))
        self.busy: str | None = None  # name of the running job
        self._quitting = False
        self.handling: str | None = None  # the job whose result is being shown
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

    def _give_back(self, text: str) -> None:
        """A refused message returns to the input box, unless the user typed on."""
        if not self.prompt.text:
            self.prompt.load_text(text)
            self.prompt.move_cursor(self.prompt.document.end)

    def _refuse_if_busy(self) -> bool:
        if self.busy:
            what = "answering" if self.busy == "turn" else f"busy ({self.busy})"
            self.notify(f"still {what}: press Esc to stop it first", severity="warning")
            return True
        return False

    def load_model(self, model: str | None, policy: KVPolicy | None = None) -> None:
        self.metrics["load_started"] = time.perf_counter()
        screen = LoadingScreen(model, can_go_back=self.engine.loaded)
        self.push_screen(screen, callback=self._loading_closed)
        self._load(model, policy)

    def _load(self, model: str | None, policy: KVPolicy | None = None) -> None:
        engine, pipe = self.engine, self.pipe

        def load():
            engine.open(
                model,
                on_status=lambda m: pipe.put(Status("load", m)),
                on_progress=lambda done, total: pipe.put(Progress("load", done, total)),
                policy=policy,
            )
            return engine.idle_stats()

        self._run_job("load", load)

    async def _loading_closed(self, failure: str | None) -> None:
        if failure:  # back to the chat after a failed load: say what happened
            await self.note(
                f"could not load the model: {failure}; still using {self.engine.model_name}",
                "error",
            )

    def _turn(self, kind: str, text: str = "") -> None:
        self._pending_policy = None  # its cost changes with the turn: ask again
        self._stop = threading.Event()
        stop, engine, pipe = self._stop, self.engine, self.pipe

        def turn():
            events = engine.send(text, stop) if kind == "send" else engine.regenerate(stop)
            last = None
            for ev in events:
                pipe.put(ev)
                if isinstance(ev, Finished):
                    last = ev.stats
            return engine.evicted(last) if last is not None else None

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
            if item.stats is not None:
                self.panel.show(item.stats)  # the cache grows chunk by chunk
            if not self._stop.is_set():
                self.set_status(
                    f"reading the prompt: {item.done}/{item.total} tokens · Esc or Ctrl+C stops"
                )
        elif isinstance(item, Notice):
            await self.note(item.message, "notice")
        elif isinstance(item, Finished):
            await self._finished(item)
        elif isinstance(item, Status | Progress):
            if isinstance(self.screen, LoadingScreen):
                self.screen.show(item)
        elif isinstance(item, Done | Failed):
            self.busy = None  # a handler may start the next job (a load, then a restore)
            self.handling = item.job
            try:
                await self._after[item.job](item)
            finally:
                self.handling = None
            if not self.busy:
                self.set_status()

    async def _finished(self, ev: Finished) -> None:
        s = ev.stats
        self.panel.show(s)
        if s.prompt_tps > 0:
            self._prefill_tps = s.prompt_tps
        reason = {"cancelled": "stopped", "stop": "done"}.get(ev.finish_reason)
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

    # -- conversations kept on disk ----------------------------------------------------------
    async def keep(self) -> None:
        """Save the conversation as it is now (atomically) to its file under the home."""
        if self.store is None or not self.engine.loaded:
            return
        try:
            self.store.save(self.engine.to_dict())
        except (UserError, OSError) as e:  # a full disk, a read-only file: the chat goes on
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            await self.note(f"could not keep the conversation: {why}", "error")

    def _mark_evicted(self, shares: list[float] | None) -> None:
        """Dim what the cache has dropped: the model no longer sees those tokens. ``shares``
        are per message of the conversation; the views show its last messages."""
        views = self.chat.messages()
        if shares is None or len(shares) < len(views):
            return
        for view, share in zip(views, shares[len(shares) - len(views) :], strict=True):
            view.set_evicted(share)

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
            screen.dismiss(None)
        self._show_policy()
        self.panel.budget = self.engine.budget
        self.panel.reset_plot()
        self.panel.show(item.result)
        self._show_sampling()
        self.prompt.focus()
        carried = len(self.engine.messages)
        text = f"loaded {self.engine.model_name} (KV policy: {self.engine.policy.describe()})"
        if carried:
            text += f"; the {carried} messages so far are read again on the next turn"
        await self.note(text)
        if self._resume is not None:
            data, self._resume = self._resume, None
            self.restore(data, "resumed the last conversation")

        def painted():
            self.metrics["first_paint_after_load"] = time.perf_counter() - loaded_at
            self.write_metrics()

        self.call_after_refresh(painted)

    async def _after_turn(self, item) -> None:
        question, self._question = self._question, None
        view, self._streaming = self._streaming, None
        if isinstance(item, Done):
            self._mark_evicted(item.result)
            await self.keep()
            return
        # The engine recorded no answer and took the message back: the view follows, the
        # error stays visible, and the typed text returns to the input box.
        await self.note(item.message, "error")
        if view is not None:
            await view.remove()
        sent = self._pending_text
        if question is not None:
            await question.remove()
        if sent and not self.prompt.text:
            self.prompt.load_text(sent)
            self.prompt.move_cursor(self.prompt.document.end)

    async def _after_policy(self, item) -> None:
        if isinstance(item, Failed):
            await self.note(f"policy unchanged: {item.message}", "error")
            return
        stats, changed, tokens = item.result
        self._show_policy()
        self.panel.show(stats, point=False)
        if not changed:
            await self.note(f"KV policy is already {self.engine.policy.describe()}; cache kept")
            return
        self.panel.reset_plot()
        self._mark_evicted([0.0] * len(self.chat.messages()))
        text = f"KV policy is now {self.engine.policy.describe()}. The old cache was dropped"
        text += f"; the next turn re-reads {tokens} tokens." if tokens else "."
        await self.note(text)
        await self.keep()

    async def _after_clear(self, item) -> None:
        if isinstance(item, Failed):
            await self.note(item.message, "error")
            return
        await self.chat.remove_children()
        self.panel.reset_plot()
        self.panel.show(item.result)
        if self.store is not None:
            self.store.start()  # the next message starts a new kept conversation
        await self.note("cleared: conversation and KV cache dropped")

    async def _after_restore(self, item) -> None:
        if isinstance(item, Failed):
            await self.note(item.message, "error")
            return
        stats, what = item.result
        await self._show_transcript()
        self._show_policy()
        self._show_sampling()
        self.panel.reset_plot()
        self.panel.show(stats)
        n = len(self.engine.messages)
        await self.note(
            f"{what} ({n} messages, KV policy {self.engine.policy.describe()}); "
            "the cache is rebuilt on the next turn"
        )

    async def _show_transcript(self) -> None:
        """The system prompt and the last SHOWN messages (a widget each: thousands would
        keep the screen from ever coming)."""
        await self.chat.remove_children()
        if self.engine.system:
            await self.note(f"system prompt: {self.engine.system}")
        messages = self.engine.messages
        if len(messages) > SHOWN:
            await self.note(
                f"{len(messages) - SHOWN:,} earlier messages are in the conversation but not "
                f"shown; the last {SHOWN} follow"
            )
        for m in messages[-SHOWN:]:
            await self.chat.add(MessageView(m["role"], m["content"]))

    def _show_policy(self) -> None:
        self.sub_title = f"{self.engine.model_name} · {self.engine.policy.describe()}"

    def _show_sampling(self) -> None:
        s = self.engine.settings
        self.panel.show_sampling(s, self.engine.sampling_source)

    # -- input -----------------------------------------------------------------------------
    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text
        if self.prompt.text == text:  # still in the box (a message posted without Enter)
            self.prompt.clear()
        command = slash.parse(text)
        if command is not None:
            self.prompt.remember(text)
            if not await self.run_command(command) and not self.prompt.text:
                # Refused: the command comes back selected, so typing replaces it and the
                # arrows edit it (never a garbled mix of two commands).
                self.prompt.load_text(text)
                self.prompt.select_all()
            return
        if not text.strip():
            self.notify("the message is empty: type something to send", severity="warning")
            return
        if not self.engine.loaded:
            self.notify("no model is loaded yet", severity="warning")
            self._give_back(text)
            return
        if self._refuse_if_busy():
            self._give_back(text)
            return
        if text.strip().startswith("//"):
            text = text.strip()[1:]
        self.prompt.remember(event.text)
        self._pending_text = text
        self._question = MessageView("user", text)
        await self.chat.add(self._question)
        self._streaming = MessageView("assistant")
        await self.chat.add(self._streaming)
        self.chat.anchor()  # sending brings the view back to the bottom
        self._turn("send", text)

    async def run_command(self, cmd: slash.Command) -> bool:
        """Run a slash command; False when it was refused (the app puts it back)."""
        name, arg = cmd.name, cmd.arg
        if name in ("/help", "/?"):
            await self.action_help()
            return True
        if name == "/copy":
            self.action_copy_last()
            return True
        if name not in slash.COMMANDS:
            await self.note(f"unknown command {name}; /help lists them", "error")
            return False
        if name == "/history" and not arg:
            try:
                await self.show_history()
            except UserError as e:
                await self.note(str(e), "error")
            return True
        if name == "/set" and not arg:
            await self.note(slash.describe_settings(self.engine.settings))
            return True
        if name == "/system" and not arg:
            await self.note(f"system prompt: {self.engine.system or '(none)'}")
            return True
        if self._refuse_if_busy():
            return False
        try:
            return await self._command(name, arg)
        except UserError as e:
            await self.note(str(e), "error")
            return False

    async def _command(self, name: str, arg: str) -> bool:
        if name == "/policy":
            return await self.ask_policy(slash.parse_policy(arg, self.engine.policy), arg)
        if name == "/set":
            values = slash.parse_set(arg)
            settings = self.engine.set_sampling(**values)
            self._show_sampling()
            await self.note(f"sampling for the next answers: {slash.describe_settings(settings)}")
            return True
        if name == "/system":
            self.engine.set_system("" if arg == "-" else arg)
            await self.note(f"system prompt set to: {self.engine.system or '(none)'}")
            await self.keep()
            return True
        if name == "/clear":
            await self.action_clear()
            return True
        if name == "/regen":
            await self.action_regenerate()
            return True
        if name == "/save":
            await self.save(arg)
            return True
        if name == "/load":
            if not arg:
                raise UserError("usage: /load PATH.json (a conversation saved with /save)")
            path = Path(arg).expanduser()
            data = read_conversation(path)
            if self.store is not None:
                self.store.start()  # a loaded file is never rewritten: keep a copy instead
            self.restore(data, f"loaded {path}")
            return True
        if name == "/history":
            saved = self._history()
            try:
                chosen = saved[int(arg) - 1]
            except (ValueError, IndexError):
                raise UserError(
                    f"/history {arg}: give a number from 1 to {len(saved)} (/history lists them)"
                ) from None
            data = read_conversation(chosen.path)
            self.store.current = chosen.path  # it goes on in its own file
            self.restore(data, f"reopened {chosen.path.name}")
            return True
        if name == "/model":
            if not arg:
                raise UserError(f"model: {self.engine.model_name}; usage: /model NAME")
            self.load_model(arg)
            return True
        raise UserError(f"{name} is not available here")  # every command is handled above

    def _history(self):
        if self.store is None:
            raise UserError("conversations are not kept in this session")
        return self.store.list()

    async def show_history(self) -> None:
        saved = self._history()
        if not saved:
            await self.note(f"no kept conversations yet (they go to {self.store.folder})")
            return
        lines = [f"kept conversations in {self.store.folder} (/history N reopens one):"]
        for i, c in enumerate(saved[:20], 1):
            here = " (this one)" if c.path == self.store.current else ""
            lines.append(
                f"{i:>3}. {c.updated.replace('T', ' ')} · {c.model} · {c.policy} · "
                f"{c.messages} messages · {c.title}{here}"
            )
        await self.note("\n".join(lines))

    async def ask_policy(self, policy: KVPolicy, spec: str) -> bool:
        """Say what a policy change costs before doing it: a conversation in the cache is
        re-read on the next turn. The first /policy shows the cost and puts the command
        back in the input; Enter again applies it."""
        if policy == self.engine.policy:
            await self.note(f"KV policy is already {policy.describe()}; cache kept")
            return True
        tokens = self.engine.reread_tokens()
        if tokens and self._pending_policy != policy:
            self._pending_policy = policy
            speed = self._prefill_tps
            cost = f" (about {tokens / speed:.0f} s at {speed:.0f} tok/s)" if speed else ""
            await self.note(
                f"/policy {spec} → {policy.describe()} drops the cache: the next turn re-reads "
                f"the conversation, {tokens} tokens{cost}. Press Enter to apply it "
                "(the command is in the input box), or edit it."
            )
            self.prompt.load_text(f"/policy {spec}")
            self.prompt.move_cursor(self.prompt.document.end)
            return True
        self._pending_policy = None
        self.set_policy(policy, tokens)
        return True

    # -- actions ---------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.busy == "turn":
            self._stop.set()
            self.engine.cancel()  # thread-safe: the loop stops at its next step
            self.set_status("stopping ...")

    def action_interrupt(self) -> None:
        """Ctrl+C: stop the answer; copy a selection in the input; else say how to quit."""
        if self.busy == "turn":
            self.action_stop()
        elif self.focused is self.prompt and self.prompt.selected_text:
            self.copy_to_clipboard(self.prompt.selected_text)
        else:
            self.notify("Ctrl+Q quits · Ctrl+C stops an answer", title="Quit?", timeout=3)

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

    def set_policy(self, policy: KVPolicy, tokens: int = 0) -> None:
        engine = self.engine

        def change():
            changed = engine.set_policy(policy)
            return engine.idle_stats(), changed, tokens

        self._run_job("policy", change)

    def restore(self, data: dict, what: str) -> None:
        """Show a saved conversation and continue it (its policy too, if it has one)."""
        engine = self.engine
        policy = None
        if data.get("policy"):
            policy = policy_from_dict(data["policy"])

        def restore():
            if policy is not None:
                engine.set_policy(policy)  # a policy the model refuses: nothing changed
            engine.restore(data)
            return engine.idle_stats(), what

        self._run_job("restore", restore)

    async def save(self, arg: str) -> None:
        path = Path(arg or f"mlxkv-chat-{datetime.now():%Y%m%d-%H%M%S}.json").expanduser()
        self.engine.save(path)
        await self.note(f"saved the transcript to {path}")

    def action_copy_last(self) -> None:
        last = self.chat.last_message("assistant")
        if last is None:
            self.notify("no answer to copy yet", severity="warning")
            return
        last.action_copy()

    def action_toggle_panel(self) -> None:
        shown = self.panel.display
        self.main.set_class(shown, "-panel-off")
        self.main.set_class(not shown, "-panel-on")

    async def action_help(self) -> None:
        await self.note(slash.help_text())

    def on_loading_screen_retry(self, msg: LoadingScreen.Retry) -> None:
        self.metrics["load_started"] = time.perf_counter()
        self._load(msg.model)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Stop the answer", "Esc or Ctrl+C", self.action_stop)
        yield SystemCommand("Regenerate", "answer the last message again", self.action_regenerate)
        yield SystemCommand("Clear the chat", "drop conversation and KV cache", self.action_clear)
        yield SystemCommand("Copy the last answer", "to the clipboard", self.action_copy_last)
        yield SystemCommand("Save the transcript", "as JSON in this folder", lambda: self.save(""))
        yield SystemCommand("Kept conversations", "/history", self.show_history)
        yield SystemCommand("Keys and commands", "help", self.action_help)
        yield SystemCommand("Show or hide the KV panel", "F2", self.action_toggle_panel)
        presets = {
            "full cache": "full",
            "sink 4 + window 256": "window=256 sinks=4 bits=none",
            "4-bit quantized": "bits=4",
            "8-bit quantized": "bits=8",
        }
        for label, spec in presets.items():
            yield SystemCommand(
                f"KV policy: {label}",
                "says what re-reading the conversation costs first",
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
        data[metrics.MARK] = self.panel.renders
        metrics.write_metrics(self.metrics_path, data)

    async def action_quit(self) -> None:
        """Stop the answer, let the worker end its job, keep what it gave, then exit."""
        if self._quitting:
            return
        self._quitting = True
        self._stop.set()
        self.engine.cancel()
        if self.busy:
            self.set_status("quitting: stopping the answer ...")
        # A stopped answer ends within a model step; a model load cannot be stopped.
        if await asyncio.to_thread(self.worker.finish, QUIT_WAIT):
            await self.on_chat_app_wake(self.Wake())  # its result: the answer is kept
        self.write_metrics()
        self.exit()

    def on_unmount(self) -> None:
        self.engine.cancel()
        self.worker.finish(timeout=2.0)
