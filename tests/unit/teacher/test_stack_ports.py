"""The local stack gives the teacher ports no other service of the stack was given."""

from flywheel.core.settings import load_settings
from flywheel.ops.stack import Stack


def test_teacher_ports_avoid_ports_already_given_to_other_services(tmp_path):
    # The reward service was moved to 50782 (its own port was busy) before anything bound it;
    # the teacher's configured 50782 is still free on the machine but must not be reused.
    s = load_settings(
        reward={"port": 50782, "metrics_port": 9782},
        teacher={"enabled": True, "port": 50782, "metrics_port": 9782, "engine_port": 50782},
        state_dir=str(tmp_path),
    )
    (engine,) = Stack(s, echo=lambda _: None)._teacher_ports()
    ports = {s.teacher.port, s.teacher.metrics_port, s.teacher.engine_port}
    assert len(ports) == 3 and not ports & {50782, 9782}
    assert engine.name == "teacher-engine" and engine.args[:2] == [
        "--port",
        str(s.teacher.engine_port),
    ]


def test_no_teacher_engine_for_a_self_teacher_or_external_engines(tmp_path):
    for extra in ({"self_teacher": True}, {"engine_urls": ["http://big:30000"]}):
        s = load_settings(teacher={"enabled": True, **extra}, state_dir=str(tmp_path))
        assert Stack(s, echo=lambda _: None)._teacher_ports() == []
    s = load_settings(state_dir=str(tmp_path))
    assert Stack(s, echo=lambda _: None)._teacher_ports() == []
    assert Stack(s, echo=lambda _: None)._teacher_service() == []
