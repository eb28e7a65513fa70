"""A small Dockerfile reader for static checks (the images cannot be built here: no Docker)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str  # upper case, e.g. "COPY"
    args: str  # the rest of the (joined) line
    stage: int  # index of the FROM stage it belongs to

    def words(self) -> list[str]:
        """Arguments as a list: JSON (exec) form when it parses, else shell words."""
        if self.args.startswith("["):
            try:
                parsed = json.loads(self.args)
            except json.JSONDecodeError:
                pass
            else:
                return [str(w) for w in parsed]
        return shlex.split(self.args, comments=False)


@dataclass
class Dockerfile:
    path: Path
    instructions: list[Instruction] = field(default_factory=list)
    global_args: dict[str, str] = field(default_factory=dict)  # ARGs before the first FROM, with defaults

    @classmethod
    def parse(cls, path: Path) -> Dockerfile:
        df = cls(path)
        logical: list[str] = []
        buf = ""
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not buf and (not line or line.startswith("#")):
                continue
            if line.startswith("#"):  # comment inside a continued instruction
                continue
            if line.endswith("\\"):
                buf += line[:-1] + " "
                continue
            logical.append(buf + line)
            buf = ""
        stage = -1
        for text in logical:
            keyword, _, args = text.partition(" ")
            keyword = keyword.upper()
            if keyword == "FROM":
                stage += 1
            elif keyword == "ARG" and stage < 0:
                name, _, default = args.strip().partition("=")
                df.global_args[name] = default
            df.instructions.append(Instruction(keyword, args.strip(), stage))
        return df

    def of(self, keyword: str, stage: int | None = None) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword and (stage is None or i.stage == stage)]

    @property
    def final_stage(self) -> int:
        return max(i.stage for i in self.instructions)

    def base_images(self) -> list[str]:
        """The image of every FROM, with global ARG defaults substituted."""
        images = []
        for ins in self.of("FROM"):
            image = ins.words()[0]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: self.global_args.get(m.group(1), m.group(0)), image)
            images.append(image)
        return images

    def stage_names(self) -> list[str]:
        names = []
        for ins in self.of("FROM"):
            words = ins.words()
            names.append(words[2] if len(words) >= 3 and words[1].upper() == "AS" else "")
        return names

    def copy_sources(self) -> list[str]:
        """Sources of COPY/ADD instructions that read the build context (not --from=stage)."""
        sources = []
        for ins in self.of("COPY") + self.of("ADD"):
            words = ins.words()
            if any(w.startswith("--from=") for w in words):
                continue
            paths = [w for w in words if not w.startswith("--")]
            sources.extend(paths[:-1])
        return sources
