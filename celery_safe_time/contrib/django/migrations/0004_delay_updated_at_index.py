# The purge's index: finished rows by updated_at.

from django.db import migrations, models

from celery_safe_time.contrib.django import adopt


class Migration(migrations.Migration):

    dependencies = [
        ('celery_safe_time', '0003_store_namespace'),
    ]

    operations = [
        adopt.AddIndex(
            model_name='delayedtask',
            index=models.Index(condition=models.Q(('status__in', ['cancelled', 'expired', 'failed', 'finished', 'sent'])), fields=['updated_at'], name='cst_delay_updated'),
        ),
    ]
