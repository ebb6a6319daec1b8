"""Teacher service entry point: `python -m flywheel.teacher [--config FILE]`.

Parse settings -> teacher tokenizer, vocabulary check against the student's and against what each
teacher engine serves -> prefill scorer on
the teacher engines -> hint judge (optional) -> gRPC server (TeacherService + health +
reflection) -> Prometheus metrics -> stream worker loop (scored -> train) until SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from flywheel.core.judge_client import judge_metrics
from flywheel.core.logs import setup_logging
from flywheel.core.settings import FlywheelSettings, load_settings_or_exit

if TYPE_CHECKING:
    from flywheel.teacher.context import TeacherRenderer

log = logging.getLogger("flywheel.teacher")


def teacher_engine_urls(settings: FlywheelSettings) -> list[str]:
    """Configured teacher engines; else the policy engines for a self-teacher, else the local
    stack's separate teacher engine (`teacher.engine_port`)."""
    ts = settings.teacher
    if ts.engine_urls:
        return ts.engine_urls
    if ts.self_teacher:
        return settings.engine_urls()
    return [f"http://{settings.engine.host}:{ts.engine_port}"]


def load_tokenizers(
    settings: FlywheelSettings, teacher_model: Path, engine_model: Path
) -> tuple[TeacherRenderer, str, str]:
    """The teacher's renderer and the (student, teacher) vocabulary fingerprints.

    Raises:
        VocabularyMismatchError: the vocabularies differ (BUG-23): the service
            refuses to start rather than score student ids the teacher reads as other text.
    """
    from flywheel.teacher.context import TeacherRenderer  # noqa: PLC0415
    from flywheel.teacher.vocab import check_same_vocab, vocab_fingerprint  # noqa: PLC0415

    ts = settings.teacher
    teacher_tok = Path(ts.tokenizer_path or teacher_model)
    student_tok = Path(ts.student_tokenizer_path or settings.gateway.tokenizer_path or engine_model)
    renderer = TeacherRenderer(teacher_tok)
    teacher_fp = vocab_fingerprint(renderer.tokenizer)
    student_fp = (
        teacher_fp
        if student_tok.resolve() == teacher_tok.resolve()
        else vocab_fingerprint(TeacherRenderer(student_tok).tokenizer)
    )
    check_same_vocab(student_fp, teacher_fp, where=f" ({teacher_tok} vs {student_tok})")
    return renderer, student_fp, teacher_fp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flywheel-teacher", description=__doc__)
    parser.add_argument("--config", default=None, help="TOML settings file")
    args = parser.parse_args(argv)
    settings = load_settings_or_exit(args.config, "flywheel-teacher")
    setup_logging(settings.log_level, service="teacher")
    log.info("settings %s", settings.dump())

    from flywheel.core.tokenizer_only import without_torch  # noqa: PLC0415

    without_torch()  # the teacher only tokenizes (its model runs on an engine)
    from prometheus_client import start_http_server  # noqa: PLC0415

    from flywheel.core.judge_client import JudgeClient  # noqa: PLC0415
    from flywheel.core.paths import resolve_model_path  # noqa: PLC0415
    from flywheel.core.redis_client import connect  # noqa: PLC0415
    from flywheel.core.streams import (  # noqa: PLC0415
        StreamConsumer,
        StreamProducer,
    )
    from flywheel.teacher.grpc_api import TeacherServicer, serve  # noqa: PLC0415
    from flywheel.teacher.hints import HintExtractor  # noqa: PLC0415
    from flywheel.teacher.pipeline import Teacher, TeacherConfig  # noqa: PLC0415
    from flywheel.teacher.scoring import TeacherScorer  # noqa: PLC0415
    from flywheel.teacher.vocab import check_served_vocab  # noqa: PLC0415
    from flywheel.teacher.worker import TeacherWorker  # noqa: PLC0415

    ts, streams = settings.teacher, settings.streams
    engine_model = resolve_model_path(settings.engine.model_path)
    teacher_model = Path(ts.model_path) if ts.model_path and not ts.self_teacher else engine_model
    renderer, student_fp, teacher_fp = load_tokenizers(settings, teacher_model, engine_model)
    urls = teacher_engine_urls(settings)
    for url in urls:  # the model each engine serves, not only the configured paths (BUG-23)
        check_served_vocab(url, renderer.tokenizer, timeout_s=ts.timeout_s)
    scorer = TeacherScorer(
        urls,
        max_batch=ts.max_batch,
        batch_wait_ms=ts.batch_wait_ms,
        max_concurrency=ts.max_concurrency,
        timeout_s=ts.timeout_s,
        max_attempts=ts.max_attempts,
    )
    hj = ts.hint_judge
    hints = None
    if hj.enabled:
        judge = JudgeClient(
            hj.base_url,
            hj.model,
            api_key=hj.api_key,
            timeout_s=hj.timeout_s,
            max_concurrency=hj.max_concurrency,
            max_attempts=hj.max_attempts,
            backoff_s=hj.backoff_s,
            temperature=hj.temperature,
            max_tokens=hj.max_tokens,
            metrics=judge_metrics("teacher"),
            name="hint",
        )
        hints = HintExtractor(
            judge, hj.prompt, hj.votes, hj.selection, hj.min_chars, hj.context_chars
        )
    config = TeacherConfig(
        model_name=ts.model_name or teacher_model.name,
        top_k=ts.top_k,
        placement=ts.hint_placement,
        require_hint=ts.require_hint,
    )
    teacher = Teacher(scorer, renderer, config, hints)

    client = connect(settings.redis_url())
    consumer = StreamConsumer.in_deployment(client, streams, "scored", "teacher", ts.consumer_name)
    producer = StreamProducer(client, streams.key("train"))
    worker = TeacherWorker(
        consumer, producer, teacher, block_ms=streams.block_ms, concurrency=ts.concurrency
    )
    if ts.metrics_port:  # before the gRPC server: a busy port fails before health says SERVING
        start_http_server(ts.metrics_port, addr=ts.host)
    server = serve(TeacherServicer(teacher, student_fp, teacher_fp, hints), ts.host, ts.port)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop.set())
    log.info(
        "teacher %s on %s (self_teacher=%s); gRPC %s:%d; %s -> %s",
        config.model_name,
        urls,
        ts.self_teacher,
        ts.host,
        ts.port,
        consumer.stream,
        producer.stream,
    )
    try:
        worker.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(grace=2)
        scorer.close()


if __name__ == "__main__":
    main()
