"""``python -m tpu_dist.launch``: the same as the ``tpu-launch`` command."""

from tpu_dist.launch import main

if __name__ == "__main__":
    main()
