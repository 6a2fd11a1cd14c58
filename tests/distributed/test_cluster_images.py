"""`flock run --workers N` on a vision-language model: batch lines with images answer as one engine does."""

import pytest

from tests.distributed.conftest import one_engine_and_cluster
from tests.multimodal.models import picture
from tests.multimodal.test_images_api import body, data_url

ray = pytest.importorskip("ray")


def test_workers_answer_lines_with_images(ray_address, llava_folder, tmp_path):
    lines = [{"custom_id": f"i{i}-q{q}", "method": "POST", "url": "/v1/chat/completions",
              "body": body(data_url(picture(i)), f"question {q}")}
             for i in range(3) for q in range(2)]
    one, cluster = one_engine_and_cluster(lines, dict(model=str(llava_folder), dtype="float32", scheduler="batchllm"),
                                          tmp_path)
    assert cluster == one
    assert len({one[f"i{i}-q0"] for i in range(3)}) == 3  # the images, not only the text, decide the answers
