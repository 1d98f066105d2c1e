"""``python -m uhead_vllm.study {collect,train,evaluate,study} ...``"""

from .commands import main

if __name__ == "__main__":
    main()
