"""What front ends ask of the engine thread: typed commands, and the kinds of failure.

Every request of a front end (the window, the server, a test) is one frozen dataclass
below, handed to :meth:`engine.worker.EngineWorker.submit` from any thread; the engine
thread's loop only dispatches each one to its handler, when its :class:`Wait` allows.
Each command has an :class:`Action`: what it was asked to do.  A failure is reported
under its command's action (the event ``engine.events.Failed(action, message)``), so a front
end tells failures apart by that member (``action is Action.FORK``), never by the
wording of a message; the member's value is the phrase a message may show ("Could not
fork the conversation").

=========================  ===========================================  ================
command                    what the engine thread does                  waits while
=========================  ===========================================  ================
LoadModel                  loads a model (replacing the loaded one)     any answer runs
NewConversation            adopts a conversation made by the caller     —
SetSampler, Rename,        change one conversation                      it answers
EditSystemPrompt,
SwitchBranch, Fork,
Delete,
ContinueWithLoadedModel
Send, Resume, Regenerate,  start an answer (numbered when submitted:    it answers, or
EditMessage,               a pause covers those submitted before it)    no sequence is
ContinueAnswer,                                                         free
SendInNewBranch
OpenCheckpoint, Export     restore / compact a chain into a sequence    no sequence is
                                                                        free
Show                       reports a conversation, brings it in         —
Complete                   answers a server request (engine.requests)   no sequence is
                                                                        free
=========================  ===========================================  ================
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar


class Action(StrEnum):
    """What the engine was doing when something failed (``engine.events.Failed.action``)."""
    LOAD_MODEL = "load the model"
    SET_SAMPLER = "change the sampler"
    NEW_CONVERSATION = "create a conversation"
    SEND = "generate"
    RESUME = "resume"
    REGENERATE = "regenerate"
    EDIT_MESSAGE = "edit the message"
    EDIT_SYSTEM_PROMPT = "edit the system prompt"
    CONTINUE_ANSWER = "continue the answer"
    SEND_IN_NEW_BRANCH = "continue in a new branch"
    SWITCH_BRANCH = "switch branch"
    FORK = "fork the conversation"
    OPEN_CHECKPOINT = "open the checkpoint"
    SHOW = "show the conversation"
    RENAME = "rename the conversation"
    DELETE = "delete the conversation"
    EXPORT = "export the checkpoint"
    CONTINUE_WITH_LOADED_MODEL = "continue with this model"
    ANSWER_REQUEST = "answer a request"
    # what the engine does on its own
    SAVE_ANSWER = "save the answer"
    AUTOSAVE = "autosave"
    SAVE_BEFORE_CLOSING = "save before closing"
    SAVE_BEFORE_EXIT = "save before exit"


@dataclass(frozen=True)
class Wait:
    """When a queued command may run (engine thread, between two generation steps)."""
    conv: uuid.UUID | None = None   # not while this conversation is answering
    sequence: bool = False          # not while every sequence holds a running answer
    everything: bool = False        # not while any answer runs


NOW = Wait()
IDLE = Wait(everything=True)


@dataclass(frozen=True)
class Command:
    """A request to the engine thread; its fields are its handler's arguments, in order."""
    action: ClassVar[Action]

    def wait(self) -> Wait:
        return NOW

    def arguments(self) -> list[Any]:
        """The handler's arguments (the fields in order, not copied)."""
        return [getattr(self, f.name) for f in fields(self)]


@dataclass(frozen=True)
class ConversationCommand(Command):
    """A command that changes one conversation: it waits while that one answers."""
    conv_id: uuid.UUID

    def wait(self) -> Wait:
        return Wait(self.conv_id)


@dataclass(frozen=True)
class AnswerCommand(ConversationCommand):
    """A command that starts an answer: it also waits for a free sequence."""

    def wait(self) -> Wait:
        return Wait(self.conv_id, sequence=True)


# -- the model and conversations -------------------------------------------------------------
@dataclass(frozen=True)
class LoadModel(Command):
    options: Any                    # engine.worker.ModelOptions
    action = Action.LOAD_MODEL

    def wait(self) -> Wait:
        return IDLE


@dataclass(frozen=True)
class NewConversation(Command):
    conv: Any                       # engine.conversation.Conversation, made by the caller
    action = Action.NEW_CONVERSATION


@dataclass(frozen=True)
class SetSampler(ConversationCommand):
    sampler: Any                    # engine.sampling.SamplerSettings
    action = Action.SET_SAMPLER


@dataclass(frozen=True)
class Rename(ConversationCommand):
    title: str
    action = Action.RENAME


@dataclass(frozen=True)
class Delete(ConversationCommand):
    action = Action.DELETE


@dataclass(frozen=True)
class Show(Command):
    conv_id: uuid.UUID
    action = Action.SHOW


@dataclass(frozen=True)
class EditSystemPrompt(ConversationCommand):
    text: str
    action = Action.EDIT_SYSTEM_PROMPT


@dataclass(frozen=True)
class SwitchBranch(ConversationCommand):
    head: Path
    action = Action.SWITCH_BRANCH


@dataclass(frozen=True)
class Fork(ConversationCommand):
    index: int
    new_id: uuid.UUID
    action = Action.FORK


@dataclass(frozen=True)
class ContinueWithLoadedModel(ConversationCommand):
    path: Path
    action = Action.CONTINUE_WITH_LOADED_MODEL


# -- answers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Send(AnswerCommand):
    text: str
    n_predict: int = -1
    action = Action.SEND


@dataclass(frozen=True)
class Resume(AnswerCommand):
    n_predict: int | None = None
    action = Action.RESUME


@dataclass(frozen=True)
class Regenerate(AnswerCommand):
    n_predict: int | None = None   # None: the answer's own limit
    action = Action.REGENERATE


@dataclass(frozen=True)
class EditMessage(AnswerCommand):
    index: int
    text: str
    n_predict: int = -1
    action = Action.EDIT_MESSAGE


@dataclass(frozen=True)
class ContinueAnswer(AnswerCommand):
    n_predict: int = -1
    action = Action.CONTINUE_ANSWER


@dataclass(frozen=True)
class SendInNewBranch(AnswerCommand):
    text: str
    n_predict: int = -1
    action = Action.SEND_IN_NEW_BRANCH


# -- files -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenCheckpoint(Command):
    path: Path
    #: the conversation the caller expects the file to hold, where it knows (a failure is
    #: reported as that conversation's: a window opening several tells them apart)
    conv_id: uuid.UUID | None = None
    action = Action.OPEN_CHECKPOINT

    def wait(self) -> Wait:
        return Wait(sequence=True)


@dataclass(frozen=True)
class Export(Command):
    path: Path
    target: Path
    action = Action.EXPORT

    def wait(self) -> Wait:
        return Wait(sequence=True)


# -- requests of the server ------------------------------------------------------------------
@dataclass(frozen=True)
class Complete(Command):
    request: Any                    # engine.requests.CompletionRequest
    action = Action.ANSWER_REQUEST

    def wait(self) -> Wait:
        return Wait(sequence=True)


# -- from the engine's own helper thread -----------------------------------------------------
@dataclass(frozen=True)
class Landed(Command):
    """The checkpoint helper thread's word that an autosave of this conversation has
    landed: the engine thread settles its writer, which announces the save (nothing is
    announced as saved before it can be loaded; saves are announced in the order made)."""
    conv_id: uuid.UUID
    path: Path                      # the file that landed
    action = Action.AUTOSAVE
