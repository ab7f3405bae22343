from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0009_job_estimate"),
    ]

    # Uploads live only while a checkpoint is taken; one open now does not say which layers it must hold, so
    # it is dropped (that checkpoint fails as never received and the job resumes from its previous one).
    operations = [
        migrations.RunSQL("DELETE FROM jobs_checkpointupload", migrations.RunSQL.noop),
        migrations.AddField(
            model_name="checkpointupload",
            name="layer_start",
            field=models.PositiveIntegerField(default=0),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="checkpointupload",
            name="layer_end",
            field=models.PositiveIntegerField(default=0),
            preserve_default=False,
        ),
    ]
