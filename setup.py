"""The build's one addition to pyproject.toml: the app's configs. In the repository they stay at the top level
(conf/); the wheel carries them inside the app's package, as experiments/conf/, where the installed app
looks for them (experiments.validate.CONF_DIR). An editable install reads conf/ in place."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithConfigs(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            target = Path(self.build_lib) / "experiments" / "conf"
            shutil.copytree(Path(__file__).parent / "conf", target, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildWithConfigs})
